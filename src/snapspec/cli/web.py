"""`snapspec web`: serve the browser page, onnxruntime-web and the exported folders from this machine.

The page (snapspec/web/*.html, *.js) is static and needs no build. Its two libraries, onnxruntime-web 1.30 and
@huggingface/tokenizers, are npm packages that `snapspec web --install` puts into a cache folder once, with `npm ci`
from the lock file shipped beside the page (pinned versions and integrity hashes); after that everything is offline.
Nothing is ever downloaded silently: a missing install is an error that says which command to run.

The server is the standard library's threading HTTP server. It answers only for the page's files, the few
onnxruntime-web and tokenizer files the page loads, and the files a verified manifest lists (checksums are checked
once, before serving), and it sends the cross-origin isolation headers so that wasm may use threads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from snapspec import SnapspecError, cache_root, manifest

from .options import MTP, NGRAM, NGRAM_MTP, add_ngram_flags, ngram_sizes, web_drafter_arg

ORT_VERSION = "1.30.0"
ORT_FILES = ("ort.webgpu.bundle.min.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
TOKENIZERS_FILES = ("tokenizers.min.mjs",)
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".json": "application/json", ".wasm": "application/wasm", ".png": "image/png"}
_PAGE_FILES = ("index.html", "style.css", "app.js", "vendor.js", "context.js", "generation.js", "drafting.js",
               "mtp.js", "ngram.js", "sampling.js", "checks.js")


def page_dir() -> Path:
    import snapspec.web
    return Path(snapspec.web.__file__).parent


def default_web_dir() -> Path:
    """Where `--install` puts the npm packages: $SNAPSPEC_WEB_DIR, else the snapspec cache folder's web/."""
    env = os.environ.get("SNAPSPEC_WEB_DIR")
    return Path(env) if env else cache_root() / "web"


def vendor_dirs(web_dir: Path | None = None) -> dict[str, Path]:
    """The folders the page's /vendor/ URLs map to, checked; a missing install is one error with the command."""
    root = Path(web_dir) if web_dir else default_web_dir()
    dirs = {"ort": root / "node_modules" / "onnxruntime-web" / "dist",
            "tokenizers": root / "node_modules" / "@huggingface" / "tokenizers" / "dist"}
    needed = [dirs["ort"] / f for f in ORT_FILES] + [dirs["tokenizers"] / f for f in TOKENIZERS_FILES]
    missing = [p for p in needed if not p.is_file()]
    if missing:
        raise SnapspecError(f"onnxruntime-web {ORT_VERSION} and @huggingface/tokenizers are not installed in {root} "
                            f"(no {missing[0].name}); run `snapspec web --install` once (npm, network), or set "
                            "SNAPSPEC_WEB_DIR to a folder where it ran")
    version = json.loads((dirs["ort"].parent / "package.json").read_text())["version"]
    if version != ORT_VERSION:
        raise SnapspecError(f"{root} holds onnxruntime-web {version}, the page needs {ORT_VERSION}; run "
                            "`snapspec web --install` again")
    return dirs


def install(web_dir: Path | None = None, log=print) -> Path:
    """npm ci of the page's pinned packages into web_dir (idempotent: a complete install is left alone)."""
    root = Path(web_dir) if web_dir else default_web_dir()
    try:
        vendor_dirs(root)
        log(f"onnxruntime-web {ORT_VERSION} and @huggingface/tokenizers already installed in {root}")
        return root
    except SnapspecError:
        pass
    npm = shutil.which("npm")
    if npm is None:
        raise SnapspecError("`snapspec web --install` needs npm (Debian: apt-get install npm; or nodejs.org)")
    root.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(page_dir() / name, root / name)
    log(f"installing onnxruntime-web {ORT_VERSION} and @huggingface/tokenizers into {root} (npm ci)")
    proc = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                          cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise SnapspecError(f"npm ci in {root} failed: {last}")
    vendor_dirs(root)
    return root


def model_entry(folder: Path, role: str) -> dict:
    """Check an exported folder (as every load does: sizes, and the hash of what changed since its last full check)
    and describe it for the page: its URL and, per graph file, the external-data files onnxruntime-web must be
    handed (it cannot open paths the way native onnxruntime does)."""
    folder = Path(folder)
    m = manifest.load(folder)
    if m.data.get("graphs", {}).get("forward") is None:
        raise SnapspecError(f"{folder} has no forward graph")
    if m.data.get("export", {}).get("embedding_dtype") == "int4":
        raise SnapspecError(f"{folder} stores its embedding in int4 (GatherBlockQuantized), which onnxruntime-web "
                            "1.30 cannot run: re-export it with --embedding-dtype fp32 (any backend) or fp16 (wasm)")
    external = {entry["file"]: sorted(manifest.external_data_locations(folder / entry["file"]))
                for role_, entry in m.data["graphs"].items() if role_ in ("forward", "replay", "mtp")}
    return {"name": folder.resolve().name or role, "url": f"models/{role}/", "external": external,
            "files": sorted({manifest.FILENAME, *m.data["files"]})}


class _Handler(SimpleHTTPRequestHandler):
    """GET/HEAD of a fixed set of files; everything else is 404."""

    def __init__(self, *args, routes: dict, config: bytes, **kwargs):
        self.routes, self.config = routes, config
        super().__init__(*args, **kwargs)

    def log_message(self, format, *args):  # quiet: the page reports progress itself
        pass

    def end_headers(self):
        # Cross-origin isolation lets onnxruntime-web's wasm use threads (SharedArrayBuffer).
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def send_head(self):
        path = unquote(urlsplit(self.path).path)
        if path == "/config.json":
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(self.config)))
            self.end_headers()
            return _Bytes(self.config)
        file = self._resolve(path)
        if file is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        f = open(file, "rb")
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", _TYPES.get(file.suffix, "application/octet-stream"))
        self.send_header("Content-Length", str(file.stat().st_size))
        self.end_headers()
        return f

    def _resolve(self, path: str) -> Path | None:
        if path == "/":
            path = "/index.html"
        prefix, _, name = path.lstrip("/").rpartition("/")
        allowed = self.routes.get(prefix)
        if allowed is None or name not in allowed[1]:
            return None
        return allowed[0] / name


class _Bytes:
    """A file-like object over bytes, for send_head's copyfile."""

    def __init__(self, data: bytes):
        self.data = data

    def read(self, n=-1):
        out, self.data = (self.data, b"") if n < 0 else (self.data[:n], self.data[n:])
        return out

    def close(self):
        pass


def check_head(folder: Path) -> None:
    """--drafter mtp: a one-line error for a target folder without an MTP head (or without its hidden output)."""
    from snapspec.runtime.head import NO_HEAD, has_head
    m = manifest.load(folder)
    if not has_head(m) or "hidden" not in m.data["graphs"]["forward"]["outputs"]:
        raise SnapspecError(NO_HEAD.format(folder=folder))


class PageServer:
    """The page and its files on host:port (port 0: any free port), in a background thread until close().
    drafter: an exported drafter folder, "mtp": the page drafts with the target's own MTP head (web/mtp.js),
    "ngram": prompt lookup (web/ngram.js; ngram: its shortest and longest suffix), or "ngram+mtp": both."""

    def __init__(self, target: Path, drafter: Path | str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 web_dir: Path | None = None, ngram: tuple[int, int] | None = None):
        draft = "model" if drafter is not None else None
        if drafter in (MTP, NGRAM_MTP):
            check_head(target)
        if drafter in (MTP, NGRAM, NGRAM_MTP):
            drafter, draft = None, drafter
        vendor = vendor_dirs(web_dir)
        models = {"target": model_entry(target, "target")}
        if drafter is not None:
            models["drafter"] = model_entry(drafter, "drafter")
        routes = {"": (page_dir(), set(_PAGE_FILES)),
                  "vendor/ort": (vendor["ort"], set(ORT_FILES)),
                  "vendor/tokenizers": (vendor["tokenizers"], set(TOKENIZERS_FILES))}
        for role, folder in (("target", target), ("drafter", drafter)):
            if folder is not None:
                routes[f"models/{role}"] = (Path(folder), set(models[role]["files"]))
        config = json.dumps({"models": {role: {k: v for k, v in e.items() if k != "files"}
                                        for role, e in models.items()}, "draft": draft,
                             **({"ngram": list(ngram)} if draft in (NGRAM, NGRAM_MTP) and ngram else {})}).encode()
        try:
            self.httpd = ThreadingHTTPServer((host, port), partial(_Handler, routes=routes, config=config))
        except OSError as exc:
            raise SnapspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}/"
        self._thread: threading.Thread | None = None

    def start(self) -> "PageServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


def add_parser(sub, runtime_flags):
    p = sub.add_parser("web", help="serve a browser page that runs the exported folders in onnxruntime-web "
                                   "(WebGPU, or wasm without an adapter), with speculative decoding")
    p.add_argument("--target", type=Path, help="exported folder the page loads as the target")
    p.add_argument("--drafter", type=web_drafter_arg,
                   help="exported drafter folder (same vocabulary), `mtp`: the target's own MTP head (a folder "
                        "exported with mtp.* weights; a folder named mtp: ./mtp), `ngram`: drafts copied from "
                        "earlier in the sequence, no drafter model, or `ngram+mtp`: both: speculative decoding")
    add_ngram_flags(p)
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--web-dir", type=Path, default=None,
                   help="where onnxruntime-web is installed (default: $SNAPSPEC_WEB_DIR or ~/.cache/snapspec/web)")
    p.add_argument("--install", action="store_true",
                   help="install onnxruntime-web and the tokenizer library into --web-dir with npm, then exit")


def run(args) -> int:
    if args.install:
        install(args.web_dir, log=print)
        return 0
    if args.target is None:
        raise SnapspecError("web: give --target FOLDER (an exported folder), or --install")
    server = PageServer(args.target, args.drafter, host=args.host, port=args.port, web_dir=args.web_dir,
                        ngram=ngram_sizes(args, [args.drafter]))
    drafter = {MTP: " + its MTP head", NGRAM: " + n-gram lookup", NGRAM_MTP: " + n-gram lookup, else its MTP head"}.get(
        str(args.drafter), f" + {args.drafter}" if args.drafter else "")
    print(f"snapspec web: serving {args.target}{drafter}"
          + f" on {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0
