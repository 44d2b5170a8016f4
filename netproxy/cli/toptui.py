"""``netproxy top``'s live view: rich draws the screen (an alternate screen, like top's), this module
reads single keys from the terminal and refreshes every ``--interval``.

Keys: ``q`` quits; ``s`` cycles the sort (connections, imbalance, name), ``c``/``i``/``n`` pick one;
``/`` starts a filter on namespace/service (typed, Enter keeps it, Esc clears it).  The rows are
toptable.rows', so the live view and ``--once`` show the same columns, 79 characters wide.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from dataclasses import dataclass
from typing import Callable, List, Optional

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from netproxy.observe import toptable, traffic

SORT_KEYS = {"c": "connections", "i": "imbalance", "n": "name"}
HELP = "q quit  s sort  c/i/n conns/imbalance/name  / filter  Esc clear"


@dataclass
class View:
    """What the keys change: the sort, the filter and whether it is being typed."""

    sort: str = "connections"
    text: str = ""
    typing: bool = False
    done: bool = False

    def key(self, ch: str) -> None:
        if self.typing:
            if ch in ("\r", "\n"):
                self.typing = False
            elif ch == "\x1b":
                self.typing, self.text = False, ""
            elif ch in ("\x7f", "\x08"):
                self.text = self.text[:-1]
            elif ch.isprintable():
                self.text += ch
            return
        if ch == "q":
            self.done = True
        elif ch == "s":
            order = traffic.SORTS
            self.sort = order[(order.index(self.sort) + 1) % len(order)] if self.sort in order else order[0]
        elif ch in SORT_KEYS:
            self.sort = SORT_KEYS[ch]
        elif ch == "/":
            self.typing, self.text = True, ""
        elif ch == "\x1b":
            self.text = ""


def screen(report: Optional[traffic.Report], view: View, interval: float) -> RenderableType:
    """The whole screen for one refresh and the view's state."""
    filt = f"filter: {view.text}" + ("_" if view.typing else "") if (view.text or view.typing) else "no filter"
    entries = f"{report.entries} entries" if report is not None else "reading conntrack"
    head = Text(f"netproxy top  {entries}  every {interval:g}s  sort: {view.sort}  {filt}", style="bold")
    # No box: toptable's widths with one space before every column but the first, 79 characters.
    table = Table(box=None, padding=0, show_edge=False, expand=False, header_style="bold")
    for i, (title, width) in enumerate(zip(toptable.HEADER, toptable.WIDTHS)):
        table.add_column((" " if i else "") + title, width=width + (1 if i else 0), no_wrap=True, overflow="ellipsis",
                         justify="left" if i < 2 else "right")
    parts: List[RenderableType] = [head, Text(HELP, style="dim")]
    if report is not None:
        ports = traffic.arrange(report.ports, view.sort, view.text)
        for row in toptable.rows(ports, report.accounting):
            port_row = not row[0].startswith(" ")
            style = "bold" if port_row else ("yellow" if row[1] in (traffic.DRAINING, traffic.GONE) else "")
            # Text, not str: rich would read an IPv6 endpoint's [address] as markup.
            table.add_row(*(Text((" " if i else "") + cell) for i, cell in enumerate(row)), style=style)
        parts.append(table)
        if not ports:
            parts.append(Text("(no connections to a service port" + (" matching the filter)" if view.text else ")")))
        if not report.accounting:
            parts.append(Text(toptable.ACCOUNTING_OFF, style="dim"))
    return Group(*parts)


def run(refresh: Callable[[], traffic.Report], interval: float, sort: str, text: str) -> None:
    """Until ``q``: a refresh every ``interval`` seconds, keys between them."""
    view = View(sort=sort, text=text)
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)  # keys one at a time, no echo; rich restores the screen, this the line mode
    try:
        with Live(screen(None, view, interval), console=Console(), screen=True, auto_refresh=False) as live:
            report: Optional[traffic.Report] = None
            due = 0.0
            while not view.done:
                now = time.monotonic()
                if now >= due:
                    report, due = refresh(), now + interval
                    live.update(screen(report, view, interval), refresh=True)
                ready, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()))
                if ready:
                    for ch in os.read(fd, 64).decode(errors="replace"):
                        view.key(ch)
                    live.update(screen(report, view, interval), refresh=True)
    except KeyboardInterrupt:
        pass  # Ctrl-C quits as q does (cbreak mode leaves the terminal's signals on)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
