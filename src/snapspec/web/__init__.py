"""snapspec.web: the browser page (static HTML and JavaScript modules, no build step) that runs exported folders in
onnxruntime-web, with the npm manifest and lock of the two libraries it needs. Served by `snapspec web`
(cli/web.py); checked by `snapspec browser-check` (cli/browser_check.py)."""
