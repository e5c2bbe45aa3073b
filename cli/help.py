"""How `surgery` help reads: -h beside --help everywhere, flags without a type (typer shows `<bool>`
after every flag, as if it took a value), and an example at the end of every command's help."""
from __future__ import annotations

from typer.core import TyperCommand, TyperGroup

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


def blank_flag_types(params: list) -> list:
    """A flag takes no value, so its help shows no type (typer's default is `<bool>`)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx):
        return blank_flag_types(super().get_params(ctx))


class Group(TyperGroup):
    command_class = Command

    def get_params(self, ctx):
        return blank_flag_types(super().get_params(ctx))


def examples(*lines: str) -> str:
    """An epilog: 'Examples:' and each command line on its own line."""
    return "[bold]Examples:[/]\n\n" + "\n\n".join(f"  $ {line}" for line in lines)
