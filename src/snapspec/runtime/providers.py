"""Execution providers: which are installed, how a session is put on one, where its OrtValues live.

WebGPU comes either built into the onnxruntime wheel (onnxruntime-webgpu, which cannot allocate device OrtValues from
Python) or as the plugin EP package `onnxruntime-ep-webgpu` on the regular wheel, which can; the plugin is registered
here on first use and its device is added with `add_provider_for_devices`.
"""

from __future__ import annotations

import logging

import onnxruntime as ort

from snapspec import SnapspecError

log = logging.getLogger("snapspec")

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}
# Where the KV cache and recurrent state live between calls. DirectML and CoreML run the linear-attention and conv
# nodes on CPU (no kernels), so their state stays on the host.
# The whole CUDA install. onnxruntime-gpu provides the same `onnxruntime` module as the CPU wheel, and pip cannot
# install one instead of the other, so the CPU wheel goes and the GPU wheel is put back whole (uninstalling the
# first removes files of the second). 1.31.1 is the newest onnxruntime-gpu (CUDA 13, cuDNN 9 from the nvidia wheels
# its cuda and cudnn extras pull), the one verified on an H200; snapspec's onnxruntime range admits it.
CUDA_WHEEL = "1.31.1"  # pyproject.toml's cuda extra pins the same
CUDA_INSTALL = ('pip install "snapspec[cuda]" && pip uninstall -y onnxruntime && '
                f'pip install --force-reinstall --no-deps onnxruntime-gpu=={CUDA_WHEEL}')
DEVICE = {"cpu": "cpu", "cuda": "cuda", "webgpu": "webgpu", "dml": "cpu", "coreml": "cpu"}
_plugin_registered = False


def _webgpu_plugin_device():
    """The plugin EP's device, registering the library once; None when the plugin package is absent."""
    global _plugin_registered
    try:
        import onnxruntime_ep_webgpu as plugin
    except ImportError:
        return None
    if not _plugin_registered:
        try:
            ort.register_execution_provider_library("webgpu", plugin.get_library_path())
        except Exception as exc:  # onnxruntime reports version or loader problems as a generic failure
            raise SnapspecError(f"the WebGPU plugin EP failed to register: {str(exc).splitlines()[0]}") from None
        _plugin_registered = True
    return next((d for d in ort.get_ep_devices() if d.ep_name == plugin.get_ep_name()), None)


def available() -> list[str]:
    names = set(ort.get_available_providers())
    have = [k for k, v in PROVIDERS.items() if v in names]
    if "webgpu" not in have:
        try:
            if _webgpu_plugin_device() is not None:
                have.append("webgpu")
        except SnapspecError:
            pass
    return have


def configure(ep: str, opts: ort.SessionOptions, allow_fallback: bool, cuda_graph: bool = False,
              shared_stream: bool = False) -> tuple[str, list[str] | None]:
    """Put `opts` on `ep`. Returns (ep actually used, providers list for InferenceSession or None when the
    device was added to the options). A missing provider is an error unless fallback is allowed. cuda_graph: the
    CUDA session captures and replays CUDA graphs (runtime/cuda_graph.py); shared_stream: it runs on snapspec's CUDA
    stream (runtime/device/stream.py), so its work queues behind other sessions' without waits. CUDA only."""
    if ep not in PROVIDERS:
        raise SnapspecError(f"unknown execution provider {ep!r}; choose one of: {', '.join(PROVIDERS)}")
    if ep == "cpu":
        return "cpu", ["CPUExecutionProvider"]
    # The plugin first, whatever get_available_providers says: once its library is registered it is listed there
    # too, and a session made from a providers list then gets no device from it (its inputs stay on the host).
    device = _webgpu_plugin_device() if ep == "webgpu" else None
    if device is not None:
        opts.add_provider_for_devices([device], {})
        return ep, None
    if PROVIDERS[ep] in ort.get_available_providers():
        if ep == "cuda":
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels, when that is where they are
            # TF32 GEMMs (the CUDA EP's default on Ampere and later) make a multi-token verify disagree with
            # one-token steps at 1e-3, enough to flip greedy choices: full fp32 keeps the contract.
            options = {"use_tf32": "0"}
            if cuda_graph:
                options["enable_cuda_graph"] = "1"
            if shared_stream:
                from .device.stream import queued, stream_for
                if queued("cuda"):
                    options["user_compute_stream"] = str(stream_for("cuda").handle)
            return ep, [(PROVIDERS[ep], options), "CPUExecutionProvider"]
        return ep, [PROVIDERS[ep], "CPUExecutionProvider"]
    have = ", ".join(available())
    hint = {"webgpu": "pip install 'snapspec[webgpu]' (and a Vulkan/Metal/D3D12 GPU driver)",
            "cuda": f"install the GPU wheel in place of the CPU one: {CUDA_INSTALL}", "dml": "pip install 'snapspec[directml]' (Windows)",
            "coreml": "CoreML ships in onnxruntime on macOS"}[ep]
    if not allow_fallback:
        raise SnapspecError(f"execution provider {ep} is not available here (available: {have}); {hint}, "
                            "or pass --allow-fallback to run on cpu")
    log.warning("execution provider %s is not available (available: %s); continuing on cpu as asked", ep, have)
    return "cpu", ["CPUExecutionProvider"]
