"""One ordered queue of device work per device, so that forwards and the small copies around them need not wait.

On CUDA every session of a model loaded with `cuda_graph` runs on one CUDA stream that snapspec creates (onnxruntime's
`user_compute_stream`), and its graph replays run with `disable_synchronize_execution_providers`: a replay returns
once it is queued. The copies that feed a fixed-address forward (token ids, positions, mask: from pinned host memory)
and the ones that pass a token from one forward to the next (device to device) are queued on the same stream with
`cudaMemcpyAsync`, so their order is the program's order and nothing waits until the host reads a result:
`DeviceIds.read()` (or `Stream.sync()`), after which the results of every queued read are on the host. A greedy draft of
k tokens is therefore k queued forwards and 2k small copies, read once, together with the target's verify.

The stream is non-blocking (as onnxruntime's own streams are): it does not wait for the legacy default stream, and
nothing waits for it except through `sync()`. Copies of state (checkpoints, zeroing) go through it too
(device/copy.py, Copier), then sync.

`SNAPSPEC_CUDA_STREAM=own` (diagnosis) keeps onnxruntime's own per-session streams: replays then wait as before and
every copy here waits on the legacy default stream, so nothing is queued across calls.

On CPU the same calls run at once (memmove), so the same code paths run in tests. Host staging for queued copies is
bump-allocated per thread and recycled at each sync: a buffer handed to a queued copy is never rewritten before the
copy has run.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from .cudart import cudart

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind


class Stream:
    """Queued copies and reads on one device; CPU: immediate."""

    device = "cpu"
    handle = 0  # the CUDA stream (cudaStream_t) sessions run on; 0 on CPU

    def __init__(self):
        self._local = threading.local()

    # -- what subclasses provide ----------------------------------------------------------------------------------
    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def _wait(self) -> None:
        pass

    # -- copies -----------------------------------------------------------------------------------------------------
    def h2d(self, dst: int, src: np.ndarray) -> None:
        """Queue dst <- src. src must come from staging() (or outlive the next sync)."""
        self._copy(dst, src.ctypes.data, src.nbytes, _H2D)

    def d2d(self, dst: int, src: int, nbytes: int) -> None:
        self._copy(dst, src, nbytes, _D2D)

    def fetch(self, ids: DeviceIds) -> None:
        """Queue the copy of ids to the host; the next sync() fills ids.host."""
        state = self._state()
        buf = self.staging(ids.n)
        self._copy(buf.ctypes.data, ids.ptr, 8 * ids.n, _D2H)
        state.pending.append((ids, buf))

    def sync(self) -> None:
        """Wait for everything queued; fill the host copies that fetch() asked for; recycle staging."""
        self._wait()
        state = self._state()
        for ids, buf in state.pending:
            ids.host = buf.copy()
        state.pending.clear()
        state.retired.clear()  # the copies queued from them have run
        state.used = 0

    # -- host staging -------------------------------------------------------------------------------------------------
    def staging(self, n: int, dtype=np.int64) -> np.ndarray:
        """A host array of n items for a queued copy: valid until the next sync() of this thread."""
        nbytes = n * np.dtype(dtype).itemsize
        if self.device == "cpu":  # copies run at once: any memory will do
            return np.empty(n, dtype=dtype)
        state = self._state()
        start = -(-state.used // 64) * 64
        if start + nbytes > state.arena.nbytes:
            # A bigger arena; the old one is kept until the next sync (copies queued from it have not run).
            state.retired.append(state.arena)
            state.arena = self._alloc_host(max(2 * state.arena.nbytes, 2 * nbytes))
            start = 0
        state.used = start + nbytes
        return state.arena.array[start:start + nbytes].view(dtype)

    def _state(self):
        s = self._local
        if not hasattr(s, "pending"):
            s.pending, s.used, s.retired = [], 0, []
            s.arena = self._alloc_host(1 << 20) if self.device != "cpu" else None
        return s


class CudaStream(Stream):
    """A non-blocking CUDA stream and pinned staging, through the CUDA runtime onnxruntime loaded."""

    device = "cuda"

    def __init__(self):
        self.rt = cudart()
        self.shared = os.environ.get("SNAPSPEC_CUDA_STREAM", "shared") != "own"
        self.handle = self.rt.create_stream() if self.shared else 0  # 0: the legacy default stream
        super().__init__()

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self.rt.memcpy_async(dst, src, nbytes, kind, self.handle)
        if not self.shared:  # sessions run on streams of their own: order by waiting
            self.rt.sync_stream(0)

    def _wait(self) -> None:
        self.rt.sync_stream(self.handle)

    def _alloc_host(self, nbytes: int):
        return self.rt.pinned(nbytes)


class DeviceIds:
    """n int64 token ids at `ptr` on a stream's device, written by queued work (a greedy draft's argmax ids).
    Whoever needs them on the device copies from ptr; read() brings them to the host, waiting once."""

    def __init__(self, stream: Stream, ptr: int, n: int):
        self.stream, self.ptr, self.n = stream, ptr, n
        self.host: np.ndarray | None = None
        self._fetched = False

    def fetch(self) -> None:
        """Queue the read, so that a sync for something else brings these too."""
        if not self._fetched:
            self._fetched = True
            self.stream.fetch(self)

    def read(self) -> np.ndarray:
        if self.host is None:
            self.fetch()
            self.stream.sync()
        return self.host


_STREAMS: dict[str, Stream] = {}
_LOCK = threading.Lock()


def queued(device: str) -> bool:
    """Whether CUDA sessions share snapspec's stream (and replays may return before they ran)."""
    return device == "cuda" and stream_for("cuda").shared


def stream_for(device: str) -> Stream | None:
    """The process's stream of a device (made on first use): cpu, cuda; None for other devices (no queued path)."""
    if device not in ("cpu", "cuda"):
        return None
    with _LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = CudaStream() if device == "cuda" else Stream()
        return _STREAMS[device]
