"""Command line: `trainermon <command>` (also `python -m trainermon <command>`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

from .collect.records import FAMILY_SWITCH


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(steps=args.steps, grad_acc=args.grad_acc, output_dir=args.output_dir)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {args.config}: ops={list(cfg.ops)} format={list(cfg.format)}")
    from .runtime.targets import idle_switches

    # What set_monitor would also say without a model: switches that select nothing (the job's size and
    # DYNAMIC_MONITOR are the launch's, unknown here: not judged)
    for message in idle_switches(cfg, world_size=sys.maxsize, dynamic=True):
        print(f"note: {message}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert
    from .csv2tb import to_tensorboard

    try:
        if args.to == "tensorboard":
            dirs = to_tensorboard(args.csv_dir, args.out)
            what = f"TensorBoard event files for {len(dirs)} rank directories"
        else:
            dirs = convert(args.csv_dir, args.out, rows_per_part=args.rows_per_part)
            what = f"{len(dirs)} part files"
    except (OSError, ValueError) as exc:  # OSError: a CSV file that cannot be read, OUT not writable
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # a re-conversion of a run replaces what an earlier one wrote for it: said, not silent
    replaced = f" (replaced {len(dirs.replaced)} earlier {_files(args.to)})" if dirs.replaced else ""
    print(f"wrote {what} to {args.out}{replaced}")
    return 0


def _files(to: str) -> str:
    return "event files" if to == "tensorboard" else "part files"


#: What `--steps` takes (anomalies, analyze, compare).
STEPS = "N or FIRST-LAST, non-negative, FIRST <= LAST"


def step_range(text: str | None) -> tuple[int, int] | None:
    """`--steps` as (first, last), None without one; ValueError unless it is what `STEPS` says."""
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    first, last = int(lo), int(hi if sep else lo)  # "5-" is refused, not read as "5"
    if first < 0 or last < first:
        raise ValueError(text)
    return first, last


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid parse value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"got {value}; allowed: a whole number >= {minimum}")
        return value

    return parse


#: `on --families` names: every family, and a short name for each pair that shares a switch.
FAMILY_ALIASES = {
    "xy": ("actv", "actv_grad"),
    "wg": ("grad_unreduced", "grad_reduced"),
    "mv": ("exp_avg", "exp_avg_sq"),
    "param": ("param_origin", "param_updated"),
}
FAMILY_NAMES = (*FAMILY_SWITCH, *FAMILY_ALIASES)


def _switch_value(current: dict, switch: str, on: bool) -> object:
    """The new value of `switch`: a section (`cc_distribution`, `attn_logit_distribution`) keeps its other
    keys (`sample`, `ops`, ...) and only its `enable` changes."""
    value = current.get(switch)
    if isinstance(value, dict):
        return {**value, "enable": on}
    return {"enable": on} if switch == "cc_distribution" else on


def _cmd_on(args: argparse.Namespace) -> int:
    from .config import ConfigError, parse_config
    from .runtime.control import update_config_file

    changes: dict = {"dynamic_on": True}
    switches: dict[str, bool] = {}  # written once the file is read: a section keeps its other keys
    if args.collect_times is not None:
        changes["collect_times"] = args.collect_times
    if args.families:
        wanted = [f.strip() for item in args.families for f in item.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in FAMILY_NAMES]
        if unknown:
            print(f"error: unknown families {unknown}; allowed: {sorted(FAMILY_NAMES)}", file=sys.stderr)
            return 2
        named = {FAMILY_SWITCH[f] for w in wanted for f in FAMILY_ALIASES.get(w, (w,))}
        switches = {switch: switch in named for switch in FAMILY_SWITCH.values()}
        changes["all_xy"] = False  # the named families decide (all_xy widens xy to every module)
        # Both set each time: the named families replace what an earlier `on --families` chose.
        both = "xy" in wanted or {"actv", "actv_grad"} <= set(wanted)
        changes["forward_only"] = "actv" in wanted and not both
        changes["backward_only"] = "actv_grad" in wanted and not both
    try:
        with open(args.config, encoding="utf-8") as fh:
            current = json.load(fh)
        if not isinstance(current, dict):
            raise ValueError("the top level must be a JSON object")
        changes |= {switch: _switch_value(current, switch, on) for switch, on in switches.items()}
        parse_config({**current, **changes}, source=args.config)  # refuse to write an invalid config
        update_config_file(args.config, **changes)
    except (OSError, ValueError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.config}: dynamic_on=true "
        + " ".join(f"{k}={json.dumps(v)}" for k, v in changes.items() if k != "dynamic_on")
    )
    return 0


def _cmd_off(args: argparse.Namespace) -> int:
    from .config import ConfigError, parse_config
    from .runtime.control import update_config_file

    try:
        new = update_config_file(args.config, dynamic_on=False)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        parse_config(new, source=args.config)
    except ConfigError as exc:  # a running job ignores an invalid file: it would go on collecting
        print(
            f"error: {args.config} now says dynamic_on=false, but a running job ignores it until the file is"
            f" a valid config: {exc}",
            file=sys.stderr,
        )
        return 2
    print(f"{args.config}: dynamic_on=false")
    return 0


def _cmd_anomalies(args: argparse.Namespace) -> int:
    import os

    from .pipeline.anomaly_files import load_anomalies

    try:
        steps = step_range(args.steps)
    except ValueError:
        print(f"error: --steps {args.steps!r}: allowed: {STEPS}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.dir):
        print(f"error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    records = load_anomalies(args.dir, steps, None if args.run_id is None else {args.run_id})
    filtered = steps is not None or args.run_id is not None
    everything = load_anomalies(args.dir) if filtered and not records else records
    runs = sorted({str(r.get("run_id", "?")) for r in everything})
    if args.run_id is not None and everything and args.run_id not in runs:
        print(f"error: --run-id {args.run_id!r}: not in {args.dir!r} (its run ids: {runs})", file=sys.stderr)
        return 2
    out = args.json or os.path.join(args.dir, "anomaly_analysis.json")
    # A filter that leaves nothing does not replace the directory's analysis with [] (--json: as asked)
    if records or args.json or not filtered:
        try:
            with open(out, "w", encoding="utf-8") as fh:
                json.dump(records, fh, indent=1)
        except OSError as exc:
            print(f"error: --json {out!r}: cannot write: {exc.strerror}", file=sys.stderr)
            return 2
    if not records:
        scope = (f" for run {args.run_id!r}" if args.run_id is not None else "") + (
            f" in steps {args.steps}" if steps is not None else ""
        )
        also = f" ({len(everything)} outside that filter; runs: {', '.join(runs)})" if everything else ""
        print(f"no anomalies recorded under {args.dir}{scope}{also}")
        return 0
    runs = list(dict.fromkeys(str(r.get("run_id", "?")) for r in records))
    print(f"{len(records)} anomalies, in the order they happened (first = first bad tensor):")
    if len(runs) > 1:  # restarts sharing the output directory: run by run (--run-id picks one)
        print(f"{len(runs)} runs, in the order they wrote: {', '.join(runs)} (--run-id RUN: one of them)")
    run_col = f"{'run':<9}" if len(runs) > 1 else ""
    shown = records[: args.top]
    width = max([17, *(len(str(r["rule"])) for r in shown)])  # AnomalyExpertCollapse: 21
    print(f"{'#':>3} {run_col}{'step':>6} {'micro':>5} {'stage':<9} {'rank':>4} {'pp':>3} ", end="")
    print(f"{'rule':<{width}} {'family':<14} stat  value  name")
    for i, r in enumerate(shown):
        micro = "-" if r.get("micro_step") is None else r["micro_step"]
        run = f"{str(r.get('run_id', '?')):<9}" if run_col else ""
        print(
            f"{i:>3} {run}{r['step']:>6} {micro:>5} {r['stage']:<9} {r['rank']:>4} {r['pp_stage']:>3} "
            f"{r['rule']:<{width}} {r['family']:<14} {r['stat']}  {r['value']:.6g}  {r['name']}"
        )
    print(f"written: {out}")
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from .analysis.commands import run_analyze

    return run_analyze(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from .analysis.commands import run_compare

    return run_compare(args)


#: `analyze` / `compare` engine when none is given (see docs/ANALYSIS.md, "Engines", for why).
DEFAULT_ENGINE = "auto"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=["auto", "parquet", "csv"],
        default="auto",
        help="which output to read (auto: Parquet if any)",
    )
    parser.add_argument(
        "--engine",
        choices=["auto", "pyarrow", "duckdb", "spark"],
        default=DEFAULT_ENGINE,
        help="what reads the rows (same findings from each; docs/ANALYSIS.md): pyarrow streams in this "
        "process, duckdb runs the analysis's SQL embedded, spark on a Spark cluster; auto (default): "
        "duckdb for Parquet when installed (measured faster), else pyarrow",
    )
    parser.add_argument(
        "--spark-master",
        default=None,
        help="Spark master URL for --engine spark (default local[*]; e.g. spark://host:7077, yarn, k8s://...)",
    )
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", action="store_true", help="show a progress bar (default: on a terminal)")
    bar.add_argument("--no-progress", action="store_true", help="never show a progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainermon", description="Low-overhead PyTorch training monitor")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT-like model on CPU with monitoring on")
    demo.add_argument("--steps", type=count(1), default=30)
    demo.add_argument("--grad-acc", type=count(1), default=2)
    demo.add_argument(
        "--output-dir",
        default=None,
        help="where to write (default: $MONITOR_OUTPUT_DIR, else ./monitor_output)",
    )
    demo.set_defaults(func=_cmd_demo)
    check = sub.add_parser("check-config", help="validate a monitor config file")
    check.add_argument("config")
    check.set_defaults(func=_cmd_check_config)
    on = sub.add_parser("on", help="switch collection on in a running job's config (DYNAMIC_MONITOR=true)")
    on.add_argument("config")
    on.add_argument("--collect-times", type=int, default=None, help="steps to collect before switching off")
    on.add_argument("--families", nargs="+", help=f"families to collect, of {sorted(FAMILY_NAMES)}")
    on.set_defaults(func=_cmd_on)
    off = sub.add_parser("off", help="switch collection off in a running job's config")
    off.add_argument("config")
    off.set_defaults(func=_cmd_off)
    an = sub.add_parser("anomalies", help="merge every rank's anomaly records in the order they happened")
    an.add_argument("dir", help="MONITOR_OUTPUT_DIR (searched recursively for anomaly_detected/)")
    an.add_argument("--top", type=count(0), default=20, help="rows to print (all are written to JSON)")
    an.add_argument("--steps", default=None, help=STEPS)
    an.add_argument("--json", default=None, help="output file (default DIR/anomaly_analysis.json)")
    an.add_argument("--run-id", default=None, help="only this run's records (restarts share DIR)")
    an.set_defaults(func=_cmd_anomalies)
    conv = sub.add_parser(
        "convert",
        help="convert CSV output (trainermon's or msprobe's) into the Parquet dataset layout or TensorBoard",
    )
    conv.add_argument("csv_dir", help="a MONITOR_OUTPUT_DIR with rank directories, or one rank directory")
    conv.add_argument(
        "out",
        help="directory to write (created if missing): the dataset root (family=.../rank=.../part-*.parquet)"
        " or the TensorBoard directories; what an earlier convert of the same run wrote there is replaced",
    )
    conv.add_argument(
        "--rows-per-part",
        type=count(1),
        default=1_000_000,
        help="rows per Parquet part file (default 1000000); a part holds whole steps, so it exceeds this "
        "only where one step alone has more rows",
    )
    conv.add_argument(
        "--to",
        choices=("parquet", "tensorboard"),
        default="parquet",
        help="output: a Parquet dataset (default) or TensorBoard event files with msprobe's tags",
    )
    conv.set_defaults(func=_cmd_convert)
    ana = sub.add_parser(
        "analyze",
        help="per-layer trends of a run: heatmaps, global grad norm and spikes, growth, first NaN/Inf",
    )
    ana.add_argument(
        "run", help="Parquet dataset, MONITOR_OUTPUT_DIR, rank directory, or CSV (msprobe's too)"
    )
    ana.add_argument("--family", action="append", help="families (repeat or comma-separate; default all)")
    ana.add_argument("--stat", action="append", help="heatmap statistics (default norm,mean,min,max)")
    ana.add_argument("--out", default=None, help="report directory (default ./trainermon_report)")
    ana.add_argument("--steps", default=None, help=STEPS)
    ana.add_argument("--ranks", action="append", help="ranks to read (default all)")
    ana.add_argument("--run-id", default=None, help="keep only this run id's rows")
    ana.add_argument("--top", type=count(1), default=10, help="layers in the growth ranking")
    ana.add_argument(
        "--max-columns", type=count(1), default=500, help="heatmap columns before steps are binned"
    )
    _common(ana)
    ana.set_defaults(func=_cmd_analyze)
    cmp_ = sub.add_parser(
        "compare",
        help="compare a run with its benchmark run; exit 0: no divergence, 1: divergence, 2: error",
    )
    cmp_.add_argument("run", help="the run to check (same kinds of RUN as analyze)")
    cmp_.add_argument("benchmark", help="the reference run (another device or software version)")
    cmp_.add_argument("--rtol", type=float, default=0.01, help="relative threshold (default 0.01 = 1%%)")
    cmp_.add_argument("--atol", type=float, default=0.0, help="absolute tolerance added to the threshold")
    cmp_.add_argument("--stat", action="append", help="statistics to compare (default norm)")
    cmp_.add_argument("--family", action="append", help="families to compare (default all in both)")
    cmp_.add_argument("--steps", default=None, help=STEPS)
    cmp_.add_argument("--out", default=None, help="report directory (default ./trainermon_compare)")
    cmp_.add_argument("--max-plots", type=count(0), default=6, help="diverging tensors to plot")
    cmp_.add_argument("--run-id", default=None, help="keep only this run id's rows of RUN (a restart)")
    cmp_.add_argument("--benchmark-run-id", default=None, help="keep only this run id's rows of BENCHMARK")
    _common(cmp_)
    cmp_.set_defaults(func=_cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # the reader left (`trainermon analyze RUN | head`): stop quietly, as a piped command does;
        # stdout to /dev/null, else the interpreter's flush at exit raises again
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for such a command
