"""The `kvray` command line: `demo` (the main job), `bench` (transfers against the alternatives),
`report` (layouts, backings, a planned transfer), `doctor` (which transports work here, and why not),
`model` (the vLLM integration's test models, each built once)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from kvray import bench, demo, doctor
from kvray.config import Settings
from kvray.errors import KvrayError
from kvray.integrations.vllm.model import MODELS
from kvray.layout import READY_LAYOUTS, BlockOrder
from kvray.memory import Backing, MemoryKind
from kvray.plan import OffsetCache, plan_transfer
from kvray.wire import Role, TransportKind


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def report(args: argparse.Namespace) -> int:
    """Build each ready-made layout, allocate two backings, plan a sample transfer, print it all."""
    settings = Settings.from_env()
    kind = MemoryKind(args.memory)
    rng = np.random.default_rng(args.seed)
    print(
        f"kvray report: {args.blocks} blocks per pool, {args.request_blocks} blocks per request, "
        f"{kind.value} memory, alignment {settings.alignment}"
    )
    for name in args.layouts:
        for order in BlockOrder:
            layout = READY_LAYOUTS[name](args.blocks, order)
            with (
                Backing.allocate(layout, kind, settings=settings) as prefill,
                Backing.allocate(layout, kind, settings=settings) as decode,
            ):
                prefill_info = prefill.engine_info(
                    "prefill-0",
                    1,
                    Role.PREFILL,
                    "local",
                    prefill.region_descriptors("prefill-0", 1, TransportKind.SHM, remote_writable=False),
                )
                decode_info = decode.engine_info(
                    "decode-0",
                    1,
                    Role.DECODE,
                    "local",
                    decode.region_descriptors("decode-0", 1, TransportKind.SHM, remote_writable=True),
                )
                local_blocks = rng.permutation(args.blocks)[: args.request_blocks]
                remote_blocks = rng.permutation(args.blocks)[: args.request_blocks]
                cache = OffsetCache()
                plan = plan_transfer(prefill_info, decode_info, local_blocks, remote_blocks, cache=cache)
                run = plan_transfer(
                    prefill_info,
                    decode_info,
                    np.arange(args.request_blocks),
                    np.arange(args.request_blocks),
                    cache=cache,
                )
                region = decode.regions[0]
                print(
                    f"\n== {name} ({order.value}): {len(layout.layers)} layers, "
                    f"{len({s.geometry for s in layout.layers})} geometries"
                )
                print(
                    f"  decode region: address {region.address:#x}, {_mib(region.nbytes)} "
                    f"(layout {_mib(layout.nbytes)}), {region.span.offset_in_allocation} bytes "
                    f"into a {_mib(region.span.alloc_nbytes)} allocation"
                )
                for layer in layout.layer_names[:2] + layout.layer_names[-1:]:
                    placement = decode.placements[layer]
                    print(
                        f"  layer {layer}: offset {placement.offset}, block stride "
                        f"{placement.block_stride}, {placement.parts} part(s) of "
                        f"{placement.part_nbytes} bytes, view {tuple(decode.view(layer).shape)}"
                    )
                print(
                    f"  scattered request: {len(plan.unmerged)} ops -> {len(plan.ops)} merged, "
                    f"{_mib(plan.nbytes)}"
                )
                print(f"  contiguous request: {len(run.unmerged)} ops -> {len(run.ops)} merged")
    return 0


def model(args: argparse.Namespace) -> int:
    """Build (once) the named test model's folder and print its path."""
    print(MODELS[args.name].build(args.cache))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    report_parser = commands.add_parser("report", help="layouts, regions, layer offsets, op counts")
    report_parser.add_argument(
        "--layouts", nargs="+", default=list(READY_LAYOUTS), choices=list(READY_LAYOUTS)
    )
    report_parser.add_argument("--blocks", type=int, default=32, help="blocks per pool")
    report_parser.add_argument("--request-blocks", type=int, default=16, help="blocks per request")
    report_parser.add_argument(
        "--memory",
        choices=[k.value for k in MemoryKind if k is not MemoryKind.CUDA] + ["cuda"],
        default="shm",
    )
    report_parser.add_argument("--seed", type=int, default=0)
    report_parser.set_defaults(handler=report)
    demo_parser = commands.add_parser(
        "demo", help="the main job: disaggregated vs colocated generation on Ray, checked token for token"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.main)
    bench_parser = commands.add_parser(
        "bench", help="kvray's transfers against memcpy, Ray's object store, RDT gloo and NIXL, verified"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.main)
    doctor_parser = commands.add_parser(
        "doctor", help="which transports work here and why not; pyverbs, RDMA devices, CUDA, versions"
    )
    doctor_parser.add_argument(
        "--check-integrity",
        action="store_true",
        help="also move one request over each transport available here (workers on a local Ray) "
        "and check it as a decode engine does; exit 1 if one fails",
    )
    doctor_parser.set_defaults(handler=lambda args: doctor.main(integrity=args.check_integrity))
    model_parser = commands.add_parser(
        "model", help="build (once) a test model's Hugging Face folder for vLLM and print its path"
    )
    model_parser.add_argument(
        "name",
        choices=list(MODELS),
        help="; ".join(f"{name}: {recipe.summary}" for name, recipe in MODELS.items()),
    )
    model_parser.add_argument(
        "--cache", metavar="DIR", default=None, help="folder of built models (default ~/.cache/kvray/models)"
    )
    model_parser.set_defaults(handler=model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KvrayError as error:
        print(f"kvray: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
