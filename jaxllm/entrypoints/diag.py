"""``jaxllm diag``: the KV cache diagnostics of a running server (``GET /debug/kv``) as text, JSON or a PNG
(``--visualize PATH``, matplotlib: ``pip install jaxllm[diag]``). ``--compact`` and ``--resize N`` first act on
every core's pool (dev-mode routes) and print what they did.

Usage: jaxllm diag [--url http://127.0.0.1:8000] [--core N] [--json] [--visualize PATH] [--compact] [--resize N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence, Union

# Cell colours of the block map: (label, colour), in the order of the codes :func:`block_codes` gives.
BLOCK_COLOURS = (
    ("null block", "#000000"),
    ("used by one request", "#1f77b4"),
    ("shared by several", "#9467bd"),
    ("pinned by the warm-up", "#ff7f0e"),
    ("cached free (revivable)", "#2ca02c"),
    ("free", "#e6e6e6"),
)


def block_codes(report: dict[str, Any]) -> list[int]:
    """One code per block (an index into :data:`BLOCK_COLOURS`) from a report's ``blocks``."""
    codes = []
    for block in report["blocks"]:
        state, holders = block["state"], block["holders"]
        if state == "null":
            codes.append(0)
        elif state == "used":
            requests = [h for h in holders if not h.startswith("<")]
            codes.append(3 if "<pinned>" in holders else 2 if len(requests) > 1 else 1)
        else:
            codes.append(4 if state == "cached_free" else 5)
    return codes


def summarize(report: dict[str, Any]) -> str:
    """The report's numbers as a few lines of text."""
    largest = report["largest_request"]
    lines = [
        f"KV blocks: {report['num_blocks']} of {report['block_size']} tokens: {report['num_used_blocks']} used "
        f"(null block and {report['num_pinned_blocks']} pinned included, {report['num_shared_blocks']} shared), "
        f"{report['num_cached_free_blocks']} cached free, {report['num_free_blocks']} free",
        f"fragmentation {report['fragmentation']:.3f} ({report['empty_allocated_slots']} of "
        f"{report['allocated_slots']} allocated slots empty); cache crowding {report['cache_crowding']:.3f} "
        "(cached free / free blocks)",
        f"queue: {report['num_running']} running, {report['num_waiting']} waiting "
        f"({report['num_preempted_waiting']} preempted); {report['num_preemptions']} preemptions so far",
        f"limits in force: max_num_seqs {report['max_num_seqs']}, max_num_batched_tokens "
        f"{report['max_num_batched_tokens']} (degradation level {report['degradation_level']})",
        f"live blocks up to id {report['highest_live_block']} with {report['num_holes']} empty below it "
        f"(jaxllm diag --compact closes them up); a resize accepts num_blocks >= {report['num_used_blocks']}",
        "largest request: " + ("none" if largest is None else
                               f"{largest['request_id']} ({largest['num_blocks']} blocks, {largest['num_tokens']} tokens)"),
    ]
    tier = report.get("host_tier")
    if tier is not None:
        lines.append(f"host tier: {tier['num_blocks']} blocks: {tier['num_cached_blocks']} cached, "
                     f"{tier['num_free_blocks']} free; {tier['num_offloaded_blocks']} offloaded and "
                     f"{tier['num_loaded_blocks']} loaded so far; {tier['hit_tokens']} prompt tokens served")
    cpool = report.get("scaled_pool")
    if cpool is not None:
        lines.append(f"scaled pool: {cpool['num_blocks']} blocks: {cpool['num_used_blocks']} used, "
                     f"{cpool['num_free_blocks']} free; {cpool['num_blocks_pooled']} taken so far")
    return "\n".join(lines)


def render_kv_report(report: dict[str, Any], path: Union[str, Path]) -> Path:
    """Write a PNG of ``report`` (the block map and per-request block histogram) to ``path``; returns the path.
    Raises ImportError: no matplotlib; ValueError: the report has no block map."""
    if "blocks" not in report:
        raise ValueError("the report has no block map: ask for it with block_map=True")
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("jaxllm diag --visualize needs matplotlib: pip install 'jaxllm[diag]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    codes = block_codes(report)
    width = max(int(math.ceil(math.sqrt(len(codes)))), 1)
    grid = np.full(width * int(math.ceil(len(codes) / width)), np.nan)
    grid[: len(codes)] = codes
    fig, (ax_map, ax_hist) = plt.subplots(1, 2, figsize=(12, 5.5), gridspec_kw=dict(width_ratios=[3, 2]))
    colours = ListedColormap([c for _, c in BLOCK_COLOURS])
    ax_map.imshow(grid.reshape(-1, width), cmap=colours, vmin=-0.5, vmax=len(BLOCK_COLOURS) - 0.5,
                  interpolation="nearest")
    ax_map.set_title(f"{report['num_blocks']} KV blocks (row-major by block id, {width} per row)")
    ax_map.set_xticks([])
    ax_map.set_yticks([])
    ax_map.legend(handles=[Patch(color=c, label=label) for label, c in BLOCK_COLOURS], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), fontsize=8)
    counts = list(report["request_blocks"].values())
    if counts:
        ax_hist.hist(counts, bins=np.arange(-0.5, max(counts) + 1.5), color=BLOCK_COLOURS[1][1], edgecolor="white")
    ax_hist.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.set_xlabel("blocks held")
    ax_hist.set_ylabel("running requests")
    ax_hist.set_title(f"fragmentation {report['fragmentation']:.2f}, cache crowding {report['cache_crowding']:.2f}")
    fig.suptitle(f"{report['num_used_blocks']} used, {report['num_cached_free_blocks']} cached free, "
                 f"{report['num_free_blocks']} free; {report['num_running']} running, {report['num_waiting']} "
                 f"waiting, {report['num_preemptions']} preemptions")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fetch_report(url: str, core: int = 0, block_map: bool = True, timeout: float = 30.0) -> dict[str, Any]:
    """``GET {url}/debug/kv`` of a running server. Raises OSError: unreachable or an error (its message)."""
    query = urllib.parse.urlencode({"core": core, "block_map": str(block_map).lower()})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/debug/kv?{query}", timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        raise OSError(f"{url}/debug/kv answered {e.code}: {e.read().decode(errors='replace')}") from None


def pool_action(url: str, action: str, num_blocks: Optional[int] = None, timeout: float = 300.0) -> list[dict[str, Any]]:
    """``POST {url}/kv_cache/{action}`` (``compact``, or ``resize`` to ``num_blocks``); one report per core.
    Raises OSError: unreachable, refused (its message), or no such route (not in dev mode)."""
    query = "" if num_blocks is None else "?" + urllib.parse.urlencode({"num_blocks": num_blocks})
    request = urllib.request.Request(f"{url.rstrip('/')}/kv_cache/{action}{query}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)["cores"]
    except urllib.error.HTTPError as e:
        hint = " (start the server with JAXLLM_SERVER_DEV_MODE=1)" if e.code == 404 else ""
        raise OSError(f"{url}/kv_cache/{action} answered {e.code}{hint}: {e.read().decode(errors='replace')}") from None


def describe_action(action: str, reports: list[dict[str, Any]]) -> str:
    """One line per core of what a compaction or resize did."""
    return "\n".join(
        f"core {i}: {action}: moved {r['num_moved_blocks']} blocks in {r['seconds'] * 1e3:.1f} ms; now {r['num_blocks']} "
        f"blocks, {r['num_used_blocks']} used" + (f"; {r['num_compilations']} programs rebuilt" if "num_compilations" in r
                                                  else "")
        for i, r in enumerate(reports))


def main(argv: Optional[Sequence[str]] = None, prog: str = "jaxllm diag") -> int:
    """Print a running server's KV diagnostics; returns 0, 1 when the server cannot be read, 2 for bad flags."""
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="KV cache diagnostics of a running jaxllm server (GET /debug/kv).")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--core", type=int, default=0, help="which data-parallel engine core (default 0)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--visualize", metavar="PNG", default=None,
                        help="write the block map and the per-request block histogram to this PNG (matplotlib)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for each answer of the server (default 30; a resize rebuilds the step "
                             "programs, so give it more on a large model)")
    parser.add_argument("--compact", action="store_true",
                        help="first move every core's live KV blocks to the low end of its pool (dev mode)")
    parser.add_argument("--resize", metavar="N", type=int, default=None,
                        help="first grow or shrink every core's KV pool to N blocks, the null block included (dev mode)")
    args = parser.parse_args(argv)
    try:
        actions = [("compact", None)] * args.compact + [("resize", args.resize)] * (args.resize is not None)
        for action, num_blocks in actions:
            print(describe_action(action, pool_action(args.url, action, num_blocks, args.timeout)),
                  file=sys.stderr if args.json else sys.stdout)
        report = fetch_report(args.url, args.core, block_map=args.json or args.visualize is not None,
                              timeout=args.timeout)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report) if args.json else summarize(report))
    if args.visualize is not None:
        print(f"wrote {render_kv_report(report, args.visualize)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
