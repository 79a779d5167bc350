"""Flags `mili serve` takes and hands on to its children, declared once: by the code that reads
them in the child.

`mili serve --device cuda` means every prefill and decode child's `--device cuda`. Rather than
declare such a flag a second time (its type, choices and help drifting from the child's),
`mili serve` borrows the declaration from the function that adds it to the child's parser
(`add_engine_arguments`, `flags.add_server_arguments`, a service's `add_arguments`), and hands
on what it was given:

    SHARED = Borrowed(add_engine_arguments, ("--device", "--dtype"))
    SHARED.declare(parser, "engine")     # mili serve --help lists them with the child's help
    SHARED.argv(args)                    # ["--device", "cuda"]: only what was given

A borrowed flag's default is None (the child's own default then applies, and its help says
what that is), unless `keep_defaults`: then `mili serve` itself has the child's default and
always hands it on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Borrowed:
    """Some flags of a child's parser, as `source` declares them."""

    source: Callable[[argparse.ArgumentParser], None]  # adds the child's flags to a parser
    names: tuple[str, ...]  # option strings, e.g. "--device"
    keep_defaults: bool = False

    def _actions(self) -> list[argparse.Action]:
        donor = argparse.ArgumentParser(add_help=False)
        self.source(donor)
        # argparse keeps a parser's declarations in `_actions`; reading them is how a flag's
        # type, choices and help are copied without repeating them.
        by_name = {name: action for action in donor._actions for name in action.option_strings}
        missing = [name for name in self.names if name not in by_name]
        if missing:
            raise ValueError(f"{self.source!r} declares no {', '.join(missing)}")
        return [by_name[name] for name in self.names]

    def declare(self, parser: argparse.ArgumentParser, title: str) -> None:
        """Add the flags to `parser` in a group of their own."""
        group = parser.add_argument_group(title)
        for name, action in zip(self.names, self._actions(), strict=True):
            default = action.default if self.keep_defaults else None
            help_text = (action.help or "").replace("%(default)s", str(action.default))
            if action.nargs == 0:  # store_true / store_false: a switch
                group.add_argument(
                    name,
                    dest=action.dest,
                    action="store_const",
                    const=action.const,
                    default=default,
                    help=help_text,
                )
            elif isinstance(action, argparse._StoreAction):
                flag = group.add_argument(
                    name,
                    dest=action.dest,
                    choices=action.choices,
                    metavar=action.metavar,
                    default=default,
                    help=help_text,
                )
                flag.type = action.type  # str when None, as argparse's default is
            else:
                raise ValueError(f"{name} ({type(action).__name__}) cannot be handed on")

    def argv(self, args: argparse.Namespace) -> list[str]:
        """The given flags as a child's command line: a switch by its name, a value after it."""
        argv: list[str] = []
        for name, action in zip(self.names, self._actions(), strict=True):
            value = getattr(args, action.dest)
            if value is None or (action.nargs == 0 and value != action.const):
                continue
            argv += [name] if action.nargs == 0 else [name, str(value)]
        return argv
