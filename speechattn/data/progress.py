"""A rich progress bar as a context manager that yields an `advance()` callable."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(
    total: int, description: str, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """`with progress_bar(n, "extracting") as advance: ... advance()`; a no-op when disabled."""
    if not enabled or total <= 0:
        yield lambda steps=1: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda steps=1: progress.advance(task, steps)
