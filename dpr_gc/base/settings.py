"""One declaration per setting: a dataclass field made with :func:`setting` carries its type, default, help,
choices, flag names (DPR/GC-DPR aliases beside the setting they alias) and whether a resumed run may change it.
From those declarations come

* the checks (:func:`check`, called by the dataclass's ``__post_init__``), so a library caller and the command line
  get the same one-line :class:`~dpr_gc.base.errors.DprGcError`;
* the command-line flags (:func:`add_arguments`) and the dataclass back from parsed flags (:func:`from_args`),
  so a default is written once and every flag has its help;
* the run's record (:func:`to_record`: plain JSON of the resolved settings) and the comparison of two records
  (:func:`changed_settings`), which refuses a resume that would change the model or the training signal.

A flag's value type (``positive_int`` and friends from :mod:`dpr_gc.base.args`) parses the command line; its
``accepts`` checks a value given in code, so both paths apply one rule with one wording.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from .args import ExtendGiven, home_expanded, one_meaning, output_dir
from .errors import DprGcError, setting_text
from .files import copied_from

FIXED = "fixed"  # changes the model or the training signal: a resumed run must keep the recorded value
FREE = "free"  # may change when a run resumes: steps, cadence of saving/evaluating, workers, logging, memory layout
UNSET = object()  # no command-line default of its own: the field's default is the flag's
RESUME_NOTE = {FIXED: "[fixed on --resume]", FREE: "[may change on --resume]"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a field declares (see :func:`setting`)."""

    flags: tuple[str, ...]
    help: str
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[tuple[Any, ...]] = None
    nargs: Optional[str] = None
    required: bool = False
    dest: Optional[str] = None
    resume: str = FIXED
    negate: bool = False
    hidden: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    cli_default: Any = UNSET
    aliases: tuple[str, ...] = ()
    negatable: bool = False
    path: bool = False
    extend: bool = False

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else ""

    def dest_name(self, field_name: str) -> str:
        if self.dest:
            return self.dest
        return self.flags[0].lstrip("-").replace("-", "_") if self.flags else field_name


@dataclasses.dataclass(frozen=True)
class Group:
    """A field holding another settings dataclass (a group by concern); ``when`` names the flag destination whose
    value (not None) brings an optional group into being from the command line (``--lora-r`` for LoRA): the group's
    other flags given without it are refused, as they would be ignored (``off`` says what the run is then, ``fix``
    what to add); ``given`` names a sibling field that receives the names of the group's fields set on the command
    line (the group's flags then default to unset, and the group is built from the given ones: the others may come
    from elsewhere, e.g. a model folder's own recipe); ``shown`` is how ``--help`` shows the default of such a
    flag, ``{}`` standing for the setting's own ("{} for a plain Hugging Face model, else the model's own");
    ``about``, shown under the group's title in ``--help``."""

    cls: type
    title: str = ""
    when: Optional[str] = None
    given: Optional[str] = None
    off: str = ""
    fix: str = ""
    shown: str = "{}"
    about: str = ""

    @property
    def when_flag(self) -> str:
        """The flag of ``when`` (``lora_r``: ``--lora-r``)."""
        return "--" + (self.when or "").replace("_", "-")


CLI_OPTIONS = ("nargs", "required", "dest", "negate", "hidden", "cli_default", "aliases", "negatable", "extend")


def setting(default: Any = dataclasses.MISSING, *flags: str, help: str, type: Optional[Callable[[str], Any]] = None,
            choices: Optional[Sequence[Any]] = None, resume: str = FIXED, path: bool = False,
            default_factory: Any = dataclasses.MISSING, **cli: Any) -> Any:
    """A dataclass field declaring one setting.

    ``flags``: its command-line names, the first one shown in errors (none: a library-only setting, still checked
    and recorded); ``type``: the flag parser (its ``accepts`` checks values given in code); ``resume``:
    :data:`FIXED` or :data:`FREE`; ``path``: a file or folder (or a list of them), compared with another record's
    by the place it names, not its spelling (``beir/``, ``./beir``), its flag expanding ``~`` as the path types of
    :mod:`dpr_gc.base.args` do. ``cli`` shapes the flag: ``nargs``,
    ``required``, ``dest``; ``extend``: a flag taking several values adds up its repeats (``--k 1 --k 5``) where
    argparse keeps the last; a bool field is a switch (``negate``: the flag sets the field to False, e.g.
    ``--separate-encoders`` for ``shared_encoder``);
    ``negatable``: a bool field gets the flag and its ``--no-`` form (``--mask-duplicate-positives`` /
    ``--no-mask-duplicate-positives``); ``hidden``: further ``(flag, argparse options)`` kept for old command lines
    and left out of ``--help``;
    ``cli_default``: the flag's default when the library's differs (``--lora-r`` has none, ``LoraSettings.r`` is
    required); ``aliases``: DPR's names, added by parsers that ask for them (``scripts/``)."""
    unknown = set(cli) - set(CLI_OPTIONS)
    if unknown:
        raise TypeError(f"setting() got unknown options {sorted(unknown)}")
    if resume not in RESUME_NOTE:
        raise ValueError(f"resume must be {FIXED!r} or {FREE!r}")
    meta = Setting(tuple(flags), help, type, tuple(choices) if choices is not None else None, cli.get("nargs"),
                   cli.get("required", False), cli.get("dest"), resume, cli.get("negate", False),
                   tuple(cli.get("hidden", ())), cli.get("cli_default", UNSET), tuple(cli.get("aliases", ())),
                   cli.get("negatable", False), path, cli.get("extend", False))
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"setting": meta})
    return dataclasses.field(default=default, metadata={"setting": meta})


def group(cls: type, title: str = "", *, when: Optional[str] = None, given: Optional[str] = None, off: str = "",
          fix: str = "", shown: str = "{}", about: str = "") -> Any:
    """A field holding the settings dataclass ``cls`` (None by default when ``when`` or ``given`` is set, else
    ``cls()``); see :class:`Group`."""
    meta = {"group": Group(cls, title or (cls.__doc__ or cls.__name__).split(":")[0].split(".")[0].strip(), when,
                           given, off, fix, shown, about)}
    if when is not None or given is not None:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(default_factory=cls, metadata=meta)


def device_setting(help: str = "torch device (default: cuda:LOCAL_RANK if available, else cpu)") -> Any:
    """``--device``, declared once for every stage (a device that exists here: cpu, cuda, cuda:N, mps)."""
    from .args import device_arg

    return setting(None, "--device", type=device_arg, resume=FREE, help=help)


def cache_dir_setting(help: str = "where parsed corpora are cached (default: $DPR_GC_CACHE/corpora, else "
                                  "~/.cache/dpr_gc/corpora)") -> Any:
    """``--cache-dir``, declared once for every stage that parses a corpus or training data; an output to the
    guard of every command that takes it (:data:`dpr_gc.base.guard.CACHE_OUTPUT`): never an input, nor inside one."""
    return setting(None, "--cache-dir", type=output_dir, resume=FREE, path=True, aliases=("--cache_dir",), help=help)


def query_prefix_setting() -> Any:
    return setting(None, "--query-prefix", help="text put before every query, e.g. 'query: ' (default: the model's "
                                                "own, else none)")


def passage_prefix_setting() -> Any:
    return setting(None, "--passage-prefix", help="text put before every passage, e.g. 'passage: ' (default: the "
                                                  "model's own, else none)")


def _setting(field: dataclasses.Field) -> Optional[Setting]:
    return field.metadata.get("setting")


def _group(field: dataclasses.Field) -> Optional[Group]:
    return field.metadata.get("group")


# --------------------------------------------------------------------------------------------- checks
def _describe(decl: Setting, name: str) -> str:
    return decl.flag or name


def as_text(value: Any) -> Any:
    """A path given in code (``os.PathLike``, each element of a list) as its string, as the command line gives it;
    any other value as it is."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, os.PathLike) for v in value):
        return type(value)(os.fspath(v) if isinstance(v, os.PathLike) else v for v in value)
    return value


def check(obj: Any) -> None:
    """Check every declared setting of the dataclass instance ``obj``: a list where the flag takes several values
    (their count where it takes a fixed number), choices and the value type's rule (each element of a list: its
    ``accepts``, else its ``refusal``, the sentence the flag's parser would refuse the value with), after turning a
    ``Path`` into its string (so records, checkpoints and model cards hold the value the command line would). A
    switch (a bool default) takes only True or False (the string ``'false'`` would turn it on), a text or path
    setting only a str (a path also an ``os.PathLike``); an integer setting any integer type but bool (a numpy
    one is kept as an int). Raises one :class:`DprGcError` naming the flag."""
    for field in dataclasses.fields(obj):
        decl = _setting(field)
        if decl is None:
            continue
        value = as_text(getattr(obj, field.name))
        object.__setattr__(obj, field.name, value)  # also on a frozen settings dataclass
        if value is None:
            continue
        name = _describe(decl, field.name)
        if isinstance(field.default, bool) and not isinstance(value, bool):
            switch = name if decl.dest_name(field.name) == field.name else f"{field.name} ({name})"
            raise DprGcError(f"{switch} must be True or False, got {value!r}")
        items = _values(decl, name, value)
        checked = [_checked(decl, _is_text(decl, field), name, item) for item in items]
        object.__setattr__(obj, field.name, type(value)(checked) if items is value else checked[0])


def _checked(decl: Setting, text: str, name: str, item: Any) -> Any:
    """One value of a setting checked (see :func:`check`; ``text``: :func:`_is_text`), as the plain Python value
    its flag type makes of it (``numpy.int64(8)``: 8), so records hold JSON numbers."""
    if text and not isinstance(item, str):
        raise DprGcError(f"{name} must be {'a path (str or os.PathLike)' if text == 'path' else 'a str'}, "
                         f"got {item!r}")
    if decl.choices is not None and item not in decl.choices:
        raise DprGcError(f"{name} must be one of {', '.join(map(str, decl.choices))}, got {item!r}")
    accepts = getattr(decl.type, "accepts", None)
    if accepts is not None and not accepts(item):
        raise DprGcError(f"{name} must be {decl.type.__name__}, got {item!r}")
    refusal = getattr(decl.type, "refusal", None)
    why = refusal(item) if refusal is not None else None
    if why:
        raise DprGcError(f"{name}: {why}")
    plain = getattr(decl.type, "plain", None)
    return plain(item) if plain is not None else item


def _is_text(decl: Setting, field: dataclasses.Field) -> str:
    """``'path'`` for a setting naming a file or folder (``path``, or a path flag type of :mod:`~dpr_gc.base.args`,
    marked ``text``), ``'text'`` for any other text setting (no flag type, no choices, not a switch), else ``''``:
    what :func:`check` requires a str of, where any other value would fail far from the call that gave it (a flag
    type marked ``words`` reads one word into a list of names: each must be a str)."""
    if decl.path or getattr(decl.type, "text", False):
        return "path"
    plain = decl.type is None or getattr(decl.type, "words", False)
    return "text" if plain and decl.choices is None and not isinstance(field.default, bool) else ""


def _values(decl: Setting, name: str, value: Any) -> Sequence[Any]:
    """The values of a setting to check one by one: the elements of a list where its flag takes several (a lone
    value there is refused: a string would be read letter by letter), also where its flag type reads one word into a
    list (``words``: ``--lora-target-modules query,value``), else the value itself."""
    several = decl.nargs in ("+", "*") or isinstance(decl.nargs, int) or getattr(decl.type, "words", False)
    if not several:
        return [value]
    if not isinstance(value, (list, tuple)):
        raise DprGcError(f"{name} takes a list of values, e.g. [{value!r}], got {value!r}")
    if isinstance(decl.nargs, int) and len(value) != decl.nargs:
        raise DprGcError(f"{name} takes {decl.nargs} values, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------- command line
def _help(decl: Setting) -> str:
    return decl.help.replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, resume_kinds: bool = False,
                  title: Optional[str] = None, dpr_aliases: bool = False, unset: bool = False,
                  shown: str = "{}", about: Optional[str] = None) -> None:
    """Add the flags of the settings dataclass ``cls`` (and of its groups, each an argument group) to ``parser``;
    ``resume_kinds`` says in every help whether ``--resume`` keeps the setting fixed; ``dpr_aliases`` adds DPR's
    flag names; ``unset``: every flag defaults to None (not given), its help showing the setting's own default in
    ``shown`` (:class:`Group`); ``about``: the text under ``title``."""
    target = parser.add_argument_group(title, about) if title else parser
    for field in dataclasses.fields(cls):
        grp = _group(field)
        if grp is not None:
            add_arguments(parser, grp.cls, resume_kinds=resume_kinds, title=grp.title, dpr_aliases=dpr_aliases,
                          unset=grp.given is not None, shown=grp.shown, about=grp.about or None)
            continue
        decl = _setting(field)
        if decl is None or not decl.flags:
            continue
        dest = decl.dest_name(field.name)
        default = decl.cli_default
        if default is UNSET:
            default = _field_default(field)
        kwargs: dict[str, Any] = {"dest": dest, "help": _help(decl)}
        if (isinstance(default, bool) or decl.negate) and unset:  # --flag / --no-flag, unset unless given
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        elif decl.negatable:  # --flag / --no-flag around the setting's default
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, bool) or decl.negate:  # a switch: the flag turns its destination's default over
            default = (not field.default) if decl.negate else default
            kwargs.update(action="store_false" if default else "store_true", default=default)
        else:
            kind = decl.type or (home_expanded if decl.path else None)  # a path flag's ~ is expanded (args.py)
            kwargs.update(default=default, type=kind, nargs=decl.nargs, required=decl.required)
            if decl.extend:
                kwargs["action"] = ExtendGiven
            if decl.choices is not None:
                kwargs["choices"] = list(decl.choices)
        if unset and kwargs.get("default") is not None:
            kwargs["default"] = None
        if decl.hidden or len(decl.flags) + (len(decl.aliases) if dpr_aliases else 0) > 1:  # spelt more than one
            kwargs = one_meaning(target, kwargs)  # way: refuse two spellings with different values
        action = target.add_argument(*decl.flags, *(decl.aliases if dpr_aliases else ()), **kwargs)
        if unset or decl.negatable:  # what applies when not given (see HelpFormatter, which shows None as not set)
            value = _shown_default(field, decl)
            action.shown_default = shown.format(value) if unset and value is not None else value
        if resume_kinds:
            action.note = RESUME_NOTE[decl.resume]  # shown after the default by dpr_gc.base.args.HelpFormatter
        for flag, options in decl.hidden:
            target.add_argument(flag, dest=dest, help=argparse.SUPPRESS, **one_meaning(target, dict(options)))


def _given(cls: type, values: Mapping[str, Any]) -> tuple[Any, tuple[str, ...]]:
    """``cls`` built from the flags given (not None) and the names of its fields they set."""
    given = {}
    for field in dataclasses.fields(cls):
        decl = _setting(field)
        if decl is not None and decl.flags and values.get(decl.dest_name(field.name)) is not None:
            value = values[decl.dest_name(field.name)]
            given[field.name] = (not value) if decl.negate else value
    return cls(**given), tuple(given)


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def _shown_default(field: dataclasses.Field, decl: Setting) -> Any:
    """The flag's value when not given, as ``--help`` shows it: a negating flag's is the field's default turned
    over (``--separate-encoders`` is False while ``shared_encoder`` is True)."""
    default = _field_default(field)
    return (not default) if decl.negate else default


def from_args(cls: type, args: Any) -> Any:
    """The ``cls`` instance of parsed flags (:func:`add_arguments`); settings without flags keep their defaults,
    so the dataclass's checks run on the result as they do for a library caller."""
    values = vars(args) if not isinstance(args, Mapping) else args
    kwargs = {}
    for field in dataclasses.fields(cls):
        grp = _group(field)
        if grp is not None and grp.given is not None:
            kwargs[field.name], kwargs[grp.given] = _given(grp.cls, values)
        elif grp is not None:
            if grp.when is None or values.get(grp.when) is not None:
                kwargs[field.name] = from_args(grp.cls, values)
            else:
                _refuse_group_flags(grp, values)
            continue
        decl = _setting(field)
        if decl is None or not decl.flags:
            continue
        dest = decl.dest_name(field.name)
        if dest not in values:
            continue
        value = values[dest]
        kwargs[field.name] = (not value) if decl.negate else value
    return cls(**kwargs)


def _refuse_group_flags(grp: Group, values: Mapping[str, Any]) -> None:
    """Refuse the flags of the optional group ``grp`` given without the flag that brings it into being (its
    ``when``): the group is not built, so they would be ignored (``--lora-alpha`` without ``--lora-r``)."""
    where = f"without {grp.when_flag}" + (f" ({grp.off})" if grp.off else "")
    rule = AppliesWhen(lambda _: False, where, grp.fix or f"add {grp.when_flag}")
    refuse_flags_that_do_not_apply(grp.cls, values, dict.fromkeys(flags_given(grp.cls, values), rule))


def _cli_defaults(cls: type, unset: bool = False) -> Iterator[tuple[str, str, Any]]:
    """``(destination, flag, value when not given)`` of every flag of ``cls`` and of its groups, as
    :func:`add_arguments` declares them."""
    for field in dataclasses.fields(cls):
        grp = _group(field)
        if grp is not None:
            yield from _cli_defaults(grp.cls, unset or grp.given is not None)
            continue
        decl = _setting(field)
        if decl is None or not decl.flags:
            continue
        default = _field_default(field) if decl.cli_default is UNSET else decl.cli_default
        if decl.negate and not decl.negatable:  # a switch: the flag turns the default over
            default = not field.default
        yield decl.dest_name(field.name), decl.flag, None if unset else default


def flags_given(cls: type, args: Any) -> dict[str, str]:
    """The flags of ``cls`` (and of its groups) whose parsed value differs from what they take when not given, by
    destination: the flags a user set (one repeated at its default changes nothing, and is not among them)."""
    values = vars(args) if not isinstance(args, Mapping) else args
    return {dest: flag for dest, flag, default in _cli_defaults(cls) if dest in values and values[dest] != default}


@dataclasses.dataclass(frozen=True)
class AppliesWhen:
    """When a flag takes effect: ``test(args)`` holds; otherwise it does not apply ``where`` ("to --source bm25")
    and ``fix`` says what to add instead of dropping it ("" when dropping is the only fix)."""

    test: Callable[[Any], bool]
    where: str
    fix: str = ""


def flags_that_do_not_apply(cls: type, args: Any, rules: Mapping[str, AppliesWhen]) -> dict[str, str]:
    """The flags of ``cls`` the user set (:func:`flags_given`) whose rule in ``rules`` (by destination) says they
    would be ignored, by destination, in the order of ``rules``."""
    given = flags_given(cls, args)
    return {dest: given[dest] for dest, rule in rules.items() if dest in given and not rule.test(args)}


def without_flags(cls: type, args: Any, dests: Iterable[str]) -> argparse.Namespace:
    """``args`` with the flags of ``cls`` at ``dests`` put back to what they take when not given."""
    defaults = {dest: default for dest, _, default in _cli_defaults(cls)}
    values = dict(vars(args) if not isinstance(args, Mapping) else args)
    return argparse.Namespace(**{**values, **{dest: defaults[dest] for dest in dests}})


def refuse_flags_that_do_not_apply(cls: type, args: Any, rules: Mapping[str, AppliesWhen]) -> None:
    """Refuse, in one line, a flag of ``cls`` the user set (:func:`flags_given`) where its rule in ``rules`` (by
    destination) says it would be ignored: a silently ignored flag is a run other than the one asked for. The line
    names every flag given that the first broken rule refuses, so one fix clears them all."""
    broken = [(flag, rules[dest]) for dest, flag in flags_that_do_not_apply(cls, args, rules).items()]
    if not broken:
        return
    rule = broken[0][1]
    flags = [flag for flag, other in broken if other is rule]
    them = "the flag" if len(flags) == 1 else "them"
    fix = f"{rule.fix}, or drop {them}" if rule.fix else f"drop {them}"
    named = flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"
    raise DprGcError(f"{named} {'does' if len(flags) == 1 else 'do'} not apply {rule.where}; {fix}")


def flag_values(obj: Any) -> argparse.Namespace:
    """The settings dataclass ``obj`` (and its groups) as the command line's parsed flags would hold it, by
    destination: what :func:`refuse_flags_that_do_not_apply` reads, so settings built in code meet the command
    line's rules. An optional group that is None has none of its flags set."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        decl = _setting(field)
        if _group(field) is not None and value is not None:
            values.update(vars(flag_values(value)))
        elif decl is not None and decl.flags:
            values[decl.dest_name(field.name)] = (not value) if decl.negate else value
    return argparse.Namespace(**values)


# --------------------------------------------------------------------------------------------- records
def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def to_record(obj: Any, places: bool = False) -> dict:
    """The settings dataclass ``obj`` as plain JSON (groups nested; tuples become lists), the format a run records
    in its output and that :func:`changed_settings` compares. A plain field, neither a setting nor a group (which
    flags were given), is no setting of the run and is left out. A path setting holding the temporary copy of a
    piped input names the pipe given (:func:`~dpr_gc.base.files.copied_from`). ``places``: a path setting naming a
    file or folder that exists is recorded absolute (:func:`place`), so that a record read from another folder names
    the same places."""
    out = {}
    for field in dataclasses.fields(obj):
        decl = _setting(field)
        if decl is None and _group(field) is None:
            continue
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            out[field.name] = to_record(value, places)
        elif decl is not None and decl.path:
            out[field.name] = _plain(place(given_paths(value)) if places else given_paths(value))
        else:
            out[field.name] = _plain(value)
    return out


def given_paths(value: Any) -> Any:
    """A path setting's value (a path, or a list of them) with each temporary copy of a piped input replaced by the
    pipe given (``/dev/fd/63``), any other value as it is."""
    if isinstance(value, (list, tuple)):
        return [given_paths(v) for v in value]
    return copied_from(value) or value


def place(value: Any) -> Any:
    """A path setting's value (a path, or a list of them) with each relative path that names an existing file or
    folder made absolute; any other (a Hugging Face model name, a folder not made yet) as it is."""
    if isinstance(value, (list, tuple)):
        return [place(v) for v in value]
    return os.path.abspath(value) if isinstance(value, str) and value and os.path.exists(value) else value


def _declarations(cls: type, prefix: str = "") -> Iterator[tuple[str, Optional[Setting], Optional[Group]]]:
    """``(dotted name, setting, group)`` for every field of ``cls`` and of its groups."""
    for field in dataclasses.fields(cls):
        name = prefix + field.name
        grp = _group(field)
        yield name, _setting(field), grp
        if grp is not None:
            yield from _declarations(grp.cls, name + ".")


def flat_record(record: Any, prefix: str = "") -> dict[str, Any]:
    """A nested record (:func:`to_record`, JSON) as ``{"group.field": value}``."""
    out: dict[str, Any] = {}
    for key, value in (record or {}).items():
        if isinstance(value, Mapping):
            out.update(flat_record(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


@dataclasses.dataclass(frozen=True)
class Change:
    """One setting that differs between a recorded run and a new one."""

    name: str
    old: Any
    new: Any
    resume: str

    def __str__(self) -> str:
        return f"{self.name} {setting_text(self.old)} -> {setting_text(self.new)}"


def changed_settings(cls: type, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The settings of ``cls`` whose recorded values differ between ``old`` and ``new`` (:func:`to_record`), named
    by their first flag (else their dotted name), each with its resume kind; an optional group present in one
    record and absent in the other is one change of the flag that brings it into being, with that flag's values
    (:func:`_toggled_groups`). Paths compare by the place
    they name (:func:`same_place`): a folder spelled ``beir/`` and then ``beir`` is no change. A plain field
    (which an earlier version recorded) is no setting and is not compared."""
    kinds: dict[str, tuple[str, str]] = {}
    paths, plain = set(), set()
    for name, decl, grp in _declarations(cls):
        plain.update([name] if decl is None and grp is None else [])
        if decl is not None:
            kinds[name] = (decl.flag or name, decl.resume)
            paths.update([name] if decl.path else [])
        elif grp is not None:
            kinds[name] = (grp.when_flag if grp.when else name, FIXED)
    flat_old, flat_new = flat_record(old), flat_record(new)
    toggled = _toggled_groups(cls, flat_old, flat_new)
    changes = []
    for key in sorted(set(flat_old) | set(flat_new), key=lambda k: list(kinds).index(k) if k in kinds else 1 << 30):
        a, b = flat_old.get(key, dataclasses.MISSING), flat_new.get(key, dataclasses.MISSING)
        group = next((g for g in toggled if key == g or key.startswith(g + ".")), None)
        if group is not None:
            changes += [toggled[group]] if toggled[group] not in changes else []
            continue
        if a == b or key in plain or (key in paths and same_place(a, b)):
            continue
        owner = next((k for k in (key, *_parents(key)) if k in kinds), None)
        flag, kind = kinds[owner] if owner else (key, FIXED)
        changes.append(Change(flag if owner == key else key, a, b, kind))
    return changes


def _toggled_groups(cls: type, flat_old: Mapping[str, Any], flat_new: Mapping[str, Any]) -> dict[str, Change]:
    """The optional groups (those a ``when`` flag brings into being) present in one flat record and absent (None or
    missing) in the other, each as one change of its ``when`` flag: ``--lora-r 4 -> (not set)``."""
    declared = list(_declarations(cls))
    toggled = {}
    for name, _, grp in declared:
        on = [any(k.startswith(name + ".") for k in flat) for flat in (flat_old, flat_new)]
        if grp is None or not grp.when or on[0] == on[1]:
            continue
        when = next((k for k, decl, _ in declared if k.startswith(name + ".") and decl is not None
                     and decl.flag == grp.when_flag), None)
        values = [flat.get(when) if present and when else None for flat, present in zip((flat_old, flat_new), on)]
        toggled[name] = Change(grp.when_flag, values[0], values[1], FIXED)
    return toggled


def same_place(a: Any, b: Any) -> bool:
    """Whether two recorded path settings (a path, or a list of paths) name the same places, relative paths taken
    from the current folder (a run records the places it read absolute: ``to_record(..., places=True)``): the
    spelling (a trailing slash, ``./``, ``a/../b``) does not matter; the content of training files is compared by
    its fingerprint elsewhere."""
    def place(value: Any) -> Any:
        if isinstance(value, str):
            return os.path.abspath(value)
        return [place(v) for v in value] if isinstance(value, list) else value

    return place(a) == place(b)


def _parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
