"""``evendp devices``: the GPUs NVML sees, their free memory, load and processes."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .._core._units import format_bytes
from .._planning._devices import NvmlUnavailableError, list_devices

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``evendp devices``."""
    parser = subparsers.add_parser(
        "devices",
        help="list GPUs with free memory, utilization and processes (NVML, no CUDA init)",
        description=(
            "List the GPUs NVML sees in PCI bus order (the order CUDA uses after "
            "evendp.select_devices or CUDA_DEVICE_ORDER=PCI_BUS_ID). Creates no CUDA context."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the devices; with no NVIDIA driver say so and succeed (CPU runs still work)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    try:
        devices = list_devices()
    except NvmlUnavailableError as exc:
        if args.json:
            print(json.dumps({"driver": False, "devices": [], "reason": str(exc)}))
        else:
            console.print(
                f"No NVIDIA driver found: {exc}\n"
                "evendp still runs on CPU (device_ids=['cpu', 'cpu'], or gloo with evendp launch)."
            )
        return 0
    if args.json:
        print(json.dumps({"driver": True, "devices": [asdict(d) for d in devices]}, indent=2))
        return 0
    if not devices:
        console.print("The NVIDIA driver is loaded but reports no GPUs.")
        return 0
    table = Table(title="GPUs (NVML, PCI bus order)")
    last = "processes (pid: memory)"
    for name in ["id", "PCI bus", "name", "total", "free", "used %", "util %", last]:
        table.add_column(name, justify="left" if name in ("PCI bus", "name", last) else "right")
    for d in devices:
        procs = ", ".join(
            f"{p.pid}" + ("" if p.used_memory is None else f": {format_bytes(p.used_memory)}")
            for p in d.processes
        )
        table.add_row(
            str(d.index),
            d.pci_bus_id,
            d.name,
            format_bytes(d.total_memory),
            format_bytes(d.free_memory),
            f"{100 * d.used_memory / d.total_memory:.0f}" if d.total_memory else "-",
            "-" if d.utilization is None else str(d.utilization),
            procs or "-",
        )
    console.print(table)
    total_free = sum(d.free_memory for d in devices)
    console.print(
        f"{len(devices)} GPU(s), {format_bytes(total_free)} free in all. Pick some with "
        "evendp.select_devices(count=..., gpu_ids=[...]) before CUDA starts."
    )
    return 0
