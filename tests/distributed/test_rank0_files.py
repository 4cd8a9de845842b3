"""Rank 0's checkpoint files on every machine at a resume (issue 35), on ranks as threads.

Each machine has a folder of its own (its ``--out``), shared by its ranks. Whatever the other
machines hold (nothing, an older copy, the same one), every rank ends with rank 0's bytes and
the same answer to which files rank 0 holds; machine 0's folder is never written to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from evendp._distributed._rank0_files import rank0_files
from tests._threaded import run_threads

NAMES = ("ckpt.pt", "ckpt.prev.pt")
_KINDS = ("missing", "stale", "same")


def _case(draw: Any) -> tuple[list[int], list[bool], dict[int, list[str]]]:
    """Each rank's machine (rank 0's is 0), which files rank 0 holds, and what each other
    machine's folder holds of each."""
    world = draw(st.integers(2, 5))
    machines = [0, *draw(st.lists(st.integers(0, 2), min_size=world - 1, max_size=world - 1))]
    held = draw(st.lists(st.booleans(), min_size=2, max_size=2))
    kinds = {m: draw(st.lists(st.sampled_from(_KINDS), min_size=2, max_size=2)) for m in (1, 2)}
    return machines, held, kinds


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_every_rank_ends_with_rank_0s_bytes_and_one_answer(data: Any) -> None:
    machines, held, kinds = _case(data.draw)
    with tempfile.TemporaryDirectory() as tmp:  # one per example, removed after it
        _every_rank_ends_with_rank_0s_bytes(Path(tmp), machines, held, kinds)


def _every_rank_ends_with_rank_0s_bytes(
    base: Path, machines: list[int], held: list[bool], kinds: dict[int, list[str]]
) -> None:
    folders = {m: base / f"machine{m}" for m in (0, 1, 2)}
    for m, folder in folders.items():
        folder.mkdir()
        for i, (name, rank0_has) in enumerate(zip(NAMES, held, strict=True)):
            kind = "same" if m == 0 else kinds[m][i]
            if kind == "stale" or (kind == "same" and rank0_has):
                (folder / name).write_bytes(f"{kind} {name} ".encode() * 1000)
    before = {p: p.read_bytes() for p in folders[0].glob("*")}
    local = [machines[:r].count(m) for r, m in enumerate(machines)]  # LOCAL_RANK

    def rank(r: int, world: int) -> Any:
        paths = [folders[machines[r]] / n for n in NAMES]
        return rank0_files(paths, machine=machines[r], local_rank=local[r])

    answers = run_threads(rank, len(machines))
    assert all(found == held for found, _ in answers)  # one answer, rank 0's
    assert {p: p.read_bytes() for p in folders[0].glob("*")} == before  # never written
    for r, (_, notes) in enumerate(answers):
        m = machines[r]
        if m == 0 or local[r] > 0:  # machine 0 reads rank 0's folder; one writer a machine
            assert notes == [], (r, notes)
            continue
        copied = [n for n, h, k in zip(NAMES, held, kinds[m], strict=True) if h and k != "same"]
        assert [note.split()[3] for note in notes] == copied, notes
        for name in copied:  # written as the checkpoints are: private
            assert (folders[m] / name).stat().st_mode & 0o777 == 0o600
    for m in set(machines) - {0}:
        for name, rank0_has in zip(NAMES, held, strict=True):
            if rank0_has:
                assert (folders[m] / name).read_bytes() == before[folders[0] / name]


def test_one_process_holds_what_its_folder_holds(tmp_path: Path) -> None:
    (tmp_path / "ckpt.pt").write_bytes(b"x")
    assert rank0_files([tmp_path / n for n in NAMES]) == ([True, False], [])
