"""The engine flags on typer commands (`run`, `serve`), with vLLM's command-line forms.

`add_engine_command(app, "run", run)` registers `run(engine: EngineArgs, **own)`: typer sees one option per
EngineArgs field (generated from the declaration in `args`), the model as a positional MODEL and `--config`,
besides the command's own parameters; a parameter the command declares itself replaces the generated one of the
same name (serve takes several `--model`s). `FlagCommand` adds what click lacks:

- `--opt a b c` for a list option, the same as `--opt a --opt b --opt c` (values run until the next flag);
- `--config FILE`: the file's keys become defaults, so flags given on the command line win;
- help in click's plain layout, which wraps but never cuts a flag name (rich's panels cut to `--max-concurren…`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperOption

from paged_backend.engine.args import CONFIG_HELP, ENGINE_FLAGS, EngineArgs, EngineFlag, config_path, read_config_file
from paged_backend.errors import InvalidRequest
from paged_backend.startup import quiet_start

ModelArgument = Annotated[str | None, typer.Argument(metavar="MODEL", help="the same as --model", show_default=False)]
ConfigOption = Annotated[str | None, typer.Option("--config", metavar="FILE", help=CONFIG_HELP)]


def _typer_parameter(flag: EngineFlag) -> inspect.Parameter:
    value_type = list[str] if flag.kind is list else flag.kind
    names = [f"{flag.name}/--no-{flag.name[2:]}"] if flag.kind is bool else flag.names
    annotation = Annotated[value_type | None, typer.Option(*names, help=flag.help, show_default=False)]
    return inspect.Parameter(flag.field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def with_engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command(engine, **own)` as a typer callback that takes every engine option, MODEL and --config."""
    own = inspect.signature(command, eval_str=True).parameters
    generated = [_typer_parameter(flag) for flag in ENGINE_FLAGS if flag.field not in own]
    for name, annotation in (("model_tag", ModelArgument), ("config", ConfigOption)):
        if name not in own:
            generated.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
            )
    fields = [parameter.name for parameter in generated if parameter.name in EngineArgs.model_fields]
    cli_only = [parameter.name for parameter in generated if parameter.name not in EngineArgs.model_fields]

    def callback(**values: Any) -> Any:
        engine = EngineArgs(**{name: values.pop(name) for name in fields})
        given = {name: values.pop(name) for name in cli_only}
        if given.get("model_tag") is not None:
            engine.model = given["model_tag"]  # vLLM's rule: the positional model wins over --model
        with quiet_start():  # the command calls started() once its engine is built
            return command(engine, **values)

    callback.__name__, callback.__doc__ = command.__name__, command.__doc__
    callback.__signature__ = inspect.Signature([p for name, p in own.items() if name != "engine"] + generated)
    return callback


def add_engine_command(
    app: typer.Typer, name: str, command: Callable[..., Any], cls: type[FlagCommand] | None = None
) -> None:
    """Register `command(engine: EngineArgs, **own)` on `app` as `name`, with the engine flags and vLLM's forms."""
    app.command(name, cls=cls or FlagCommand)(with_engine_options(command))


def spread_lists(args: list[str], list_options: set[str]) -> list[str]:
    """`--opt a b --x` as `--opt a --opt b --x` for each option in `list_options` (what click can parse).

    >>> spread_lists(["--lora-modules", "a=1", "b=2", "--port", "8"], {"--lora-modules"})
    ['--lora-modules', 'a=1', '--lora-modules', 'b=2', '--port', '8']
    """
    spread: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if token == "--":
            return spread + args[index - 1 :]
        spread.append(token)
        if token in list_options:
            while index < len(args) and not args[index].startswith("-"):
                if spread[-1] != token:
                    spread.append(token)
                spread.append(args[index])
                index += 1
    return spread


class FlagCommand(TyperCommand):
    """A typer command that also reads vLLM's forms: several values after one list flag, and `--config FILE`."""

    config_sections: frozenset[str] = frozenset()  # top-level keys of --config that are not flags

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "rich_markup_mode": None})  # plain help: no flag name is ever cut

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        path = config_path(args)
        if path is not None:
            ctx.default_map = {**(ctx.default_map or {}), **self._config_defaults(path)}
        lists = {name for param in self._options() if param.multiple for name in param.opts}
        return super().parse_args(ctx, spread_lists(args, lists))

    def _options(self) -> list[TyperOption]:
        return [param for param in self.params if isinstance(param, TyperOption)]

    def _config_defaults(self, path: str) -> dict[str, Any]:
        """The file's values by parameter name (click's default_map: used where the command line gives none)."""
        try:
            values = read_config_file(path)
        except InvalidRequest as error:
            raise typer.BadParameter(str(error), param_hint="--config") from error
        by_flag = {name.lstrip("-"): param for param in self._options() for name in param.opts}
        unknown = sorted(set(values) - set(by_flag) - self.config_sections - {"config"})
        if unknown:
            raise typer.BadParameter(
                f"{path}: unknown key(s) {', '.join(unknown)}; the keys are this command's flag names",
                param_hint="--config",
            )
        defaults = {}
        for key, value in values.items():
            param = by_flag.get(key)
            if param is not None and value is not None:
                defaults[param.name] = [value] if param.multiple and not isinstance(value, list) else value
        return defaults
