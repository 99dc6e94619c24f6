"""`snapspec doctor`: which execution providers are installed here, which GPU adapters exist, and which providers
will actually run snapspec's graphs on this machine, with the reason when one will not."""

from __future__ import annotations

import platform

import onnxruntime as ort

from .options import add_json_flag


def _adapters() -> tuple[list[dict], str | None]:
    """WebGPU adapters as the `wgpu` package sees them (optional dependency)."""
    try:
        import wgpu
    except ImportError:
        return [], "the `wgpu` package is not installed (pip install wgpu) to list WebGPU adapters"
    out = []
    try:
        for adapter in wgpu.gpu.enumerate_adapters_sync():
            info = dict(adapter.info)
            out.append({"device": info.get("device"), "vendor": info.get("vendor"),
                        "adapter_type": info.get("adapter_type"), "backend": info.get("backend_type"),
                        "max_storage_buffers_per_shader_stage":
                            adapter.limits.get("max_storage_buffers_per_shader_stage")})
    except Exception as exc:  # wgpu raises its own error types when no backend loads
        return [], f"wgpu could not enumerate adapters: {str(exc).splitlines()[0]}"
    return out, None


def diagnose() -> dict:
    from snapspec.runtime.providers import CUDA_INSTALL, PROVIDERS, available

    installed = ort.get_available_providers()
    usable = available()
    adapters, adapter_note = _adapters()
    verdict = {}
    for ep, name in PROVIDERS.items():
        if ep in usable:
            verdict[ep] = "available"
            if ep == "cuda":
                verdict[ep] += ("; takes fp16 exports (--dtype fp16, int4 too: onnxruntime-gpu has no float32 "
                                "GroupQueryAttention kernel); a hybrid target runs its state-window graph")
            if ep in ("dml", "coreml"):
                verdict[ep] += "; linear-attention and conv nodes run on CPU (no kernels)"
            continue
        if ep == "webgpu":
            try:
                import onnxruntime_ep_webgpu  # noqa: F401
                software = [a for a in adapters if str(a.get("adapter_type", "")).lower() in ("cpu", "software")]
                why = "the WebGPU plugin is installed but found no GPU adapter"
                if software:
                    why += (f" (only a software adapter: {software[0]['device']}, which the WebGPU EP rejects)")
                elif not adapters:
                    why += " (no Vulkan/Metal/D3D12 driver or loader: on Linux install libvulkan1 and a GPU driver)"
                verdict[ep] = why
            except ImportError:
                verdict[ep] = "not installed: pip install 'snapspec[webgpu]'"
        elif ep == "cuda":
            verdict[ep] = f"not installed: {CUDA_INSTALL} (and an NVIDIA driver for CUDA 13)" + _gpu_version()
        elif ep == "dml":
            verdict[ep] = "Windows only: pip install 'snapspec[directml]'" if platform.system() != "Windows" else \
                "not installed: pip install 'snapspec[directml]'"
        elif ep == "coreml":
            verdict[ep] = "macOS only (ships in onnxruntime there)" if platform.system() != "Darwin" else \
                "not in this onnxruntime build"
    return {"onnxruntime": ort.__version__, "installed_providers": installed, "snapspec_providers": usable,
            "webgpu_adapters": adapters, "adapter_note": adapter_note, "verdict": verdict,
            "platform": platform.platform(), "python": platform.python_version()}


def _gpu_version() -> str:
    """Why the CUDA install names another version than the onnxruntime here: the newest onnxruntime-gpu is older
    than the newest CPU wheel, and it replaces the CPU wheel's `onnxruntime` module (runtime/providers.py)."""
    from snapspec.runtime.providers import CUDA_WHEEL

    if ort.__version__ == CUDA_WHEEL:
        return ""
    return (f"; onnxruntime-gpu {CUDA_WHEEL} (the newest GPU build when snapspec pinned it) replaces this "
            f"onnxruntime {ort.__version__}: onnxruntime becomes {CUDA_WHEEL}, which snapspec supports")


def add_parser(sub, runtime_flags):
    p = sub.add_parser("doctor", help="which execution providers will work here, and why not")
    add_json_flag(p, "the diagnosis")


def run(args) -> int:
    from .options import console, json_to_stdout, write_json

    info = diagnose()
    if args.json:
        write_json(args, info)
    if json_to_stdout(args):
        return 0
    from rich.markup import escape
    from rich.table import Table

    con = console()
    con.print(f"onnxruntime {info['onnxruntime']} on {info['platform']}, Python {info['python']}")
    t = Table(title="execution providers")
    t.add_column("--ep")
    t.add_column("verdict")
    for ep, why in info["verdict"].items():
        t.add_row(ep, f"[green]{escape(why)}[/]" if why.startswith("available") else escape(why))
    con.print(t)
    if info["webgpu_adapters"]:
        for a in info["webgpu_adapters"]:
            con.print(f"WebGPU adapter: {a['device']} ({a['vendor']}), {a['adapter_type']}, {a['backend']}, "
                      f"{a['max_storage_buffers_per_shader_stage']} storage buffers per shader stage")
    elif info["adapter_note"]:
        con.print(escape(info["adapter_note"]))
    return 0
