"""pair-a's int4 target on an emulated AVX2 CPU (no AVX-512): the 8-token == 8 one-token check, probe off and on.

    apt-get install qemu-user
    snapspec export ../shared/models/pair-a/target -o /tmp/t32 --quant int4 --block-size 32
    snapspec export ../shared/models/pair-a/target -o /tmp/t16 --quant int4
    PYTHONPATH=src:.venv/lib/python3.11/site-packages qemu-x86_64 -cpu Haswell /usr/bin/python3 \
        benchmarks/int4_avx2_emulated.py /tmp/t32 /tmp/t16

qemu's Haswell model reports AVX2 and FMA and no AVX-512, so onnxruntime's MLAS picks its AVX2 kernels, as on the
AMD EPYC of issue 23, whatever the host is. "no probe" loads the graph as exported (the probe's verdict ignored);
"probe" is the runtime as shipped (runtime/exactness.py). Slow (emulated: minutes per load); no timing is meant.
"""
import sys, time
from snapspec.runtime import exactness, model, contract
for folder in sys.argv[1:]:
    for probe in (False, True):
        real = exactness.needs_fallback
        if not probe:
            exactness.needs_fallback = lambda m, t: []
        t0 = time.time()
        m = model.load(folder, threads=1)
        c = contract.check_multi_vs_single(m)
        exactness.needs_fallback = real
        print(folder, "probe" if probe else "no probe", c.passed, c.detail, m.notes, f"{time.time() - t0:.0f}s",
              flush=True)
