"""`snapspec conformance`: the project's contract (snapspec.runtime.contract), run on the user's exported pair and
provider, with the per-node placement of each graph."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from snapspec import SnapspecError, manifest
from snapspec.runtime.contract import Check, run_checks


def add_parser(sub, runtime_flags):
    p = sub.add_parser("conformance", help="check an exported pair against snapspec's contract on a provider")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--window", type=int, default=None, help="rollback window to check (default: the export's)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, dest="json_out", help="write the report here")
    runtime_flags(p)


def run(args) -> int:
    from .options import load_models
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=False)
    checks: list[Check] = []
    try:
        manifest.load(args.target)
        if args.drafter:
            manifest.load(args.drafter)
        checks.append(Check("manifest and checksums valid", True, "all files match their sha256", where="files"))
    except SnapspecError as exc:
        checks.append(Check("manifest and checksums valid", False, str(exc), where="files"))
        return _report(con, Table, checks, {}, args)
    target, drafter = load_models(args, args.target, args.drafter)
    checks += run_checks(target, drafter, args.window, args.new_tokens)
    from snapspec.runtime.placement import node_placement
    graph = "forward_window" if target.state_window else "forward"
    placement = {"target": {"session": target.providers_used(), "graph": graph,
                            **node_placement(args.target, target.ep, graph)}}
    if drafter:
        placement["drafter"] = {"session": drafter.providers_used(), **node_placement(args.drafter, drafter.ep)}
    return _report(con, Table, checks, placement, args)


def _report(con, Table, checks, placement, args) -> int:
    table = Table(title="snapspec conformance")
    for col in ("check", "part", "result", "detail", "s"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, c.where, "[green]pass[/]" if c.passed else "[red]FAIL[/]", c.detail, f"{c.seconds:.1f}")
    con.print(table)
    for part, p in placement.items():
        nodes = ", ".join(f"{n} nodes on {prov}" for prov, n in p["providers"].items())
        fell = [f"{op} x{n}" for op, n in p["cpu_ops"].items()] if len(p["providers"]) > 1 else []
        con.print(f"{part}: {nodes}" + (f"; on CPU: {', '.join(fell)}" if fell else ""))
    ok = all(c.passed for c in checks)
    if args.json_out:
        args.json_out.write_text(json.dumps({"passed": ok, "checks": [asdict(c) for c in checks],
                                             "providers": placement, "ep": args.ep}, indent=2))
    failed = [c.name for c in checks if not c.passed]
    con.print("[green]all checks passed[/]" if ok else f"[red]failed:[/] {'; '.join(failed)}")
    return 0 if ok else 1
