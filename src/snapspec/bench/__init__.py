"""snapspec.bench: what `snapspec bench` measures and how it reports it (docs/bench.md).

    plan.py     what to measure: the quick plan (plain, the probe's best fixed k, adaptive k), the sweep, a list,
                one fixed k, plain only; the configurations they expand to
    run.py      the measurement: A B A brackets, the cost model, the probe, every text checked against plain
    figures.py  the arithmetic: spreads, the drift rule, the cost model's predictions, acceptance from a probe
    summary.py  the result as one JSON-ready dict
    report.py   the header lines, one 80-column table per drafter, the plot
    genai_compare.py  onnxruntime-genai's plain decoding of the same folder (--vs-genai)
"""
