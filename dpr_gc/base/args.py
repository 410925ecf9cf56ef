"""Command-line plumbing shared by every entry point: a parser whose mistakes are one ``error:`` line, and flag
types that validate numbers and devices while the command line is parsed, before anything is read or written."""

from __future__ import annotations

import argparse
import difflib
import math
import numbers
import os
import sys
from gettext import gettext
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn, Optional, Sequence

from .errors import DprGcError, say, shown_by_another_rank
from .files import BESIDE_BYTES, check_output_dir, check_output_file, check_path_length

ERROR_EXIT = 2
FLAG_CUTOFF = 0.8  # how alike a misspelt flag and an option are for "did you mean" (--lr and --lora-r: 0.67)


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default after its help (unless the help already says it, as ``default: ...``;
    switches are off unless given, required options have none), then the option's ``note`` if it has one (e.g.
    "[fixed on --resume]")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        note = getattr(action, "note", "")
        return f"{self._with_default(action)} {note}" if note else self._with_default(action)

    def _with_default(self, action: argparse.Action) -> str:
        text = action.help or ""
        switch = action.nargs == 0 and not hasattr(action, "shown_default")
        if (not action.option_strings or action.required or switch or "default:" in text.lower()
                or action.default is argparse.SUPPRESS):
            return text
        default = getattr(action, "shown_default", action.default)
        shown = "not set" if default is None else (" ".join(map(str, default)) if isinstance(default, (list, tuple))
                                                   else str(default))
        return f"{text} (default: {(shown or 'none').replace('%', '%%')})"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` keeping the description's lines as written (a script's docstring with examples)."""


class OneMeaning(argparse.Action):
    """Mixed into the actions of flags spelt more than one way (``--batch-size``/``--batch_size``, a setting and its
    hidden old aliases, see :func:`one_meaning`): a command line giving two spellings with different values is
    refused, naming both, where the last one would silently win (``--precision bf16 --fp16``); one spelling
    given again keeps argparse's rule, the last value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        value, set_by = getattr(namespace, self.dest), getattr(parser, "set_by", None)
        if set_by is None:  # a parser that is not ours keeps argparse's own rule
            return
        before, flag = set_by.get(self.dest, (value, option_string))
        if flag != option_string and before != value:
            raise argparse.ArgumentError(None, f"argument {option_string}: contradicts {flag}, given before it; give "
                                               "one of the two")
        set_by[self.dest] = (value, option_string)


class ExtendGiven(argparse._StoreAction):
    """The action of a flag taking several values whose repeats add up (``--k 1 --k 5``: cut-offs 1 and 5), where
    argparse keeps the last; the first use replaces the default rather than adding to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        before = getattr(namespace, self.dest, None)
        first = before is None or before is self.default
        setattr(namespace, self.dest, list(values) if first else [*before, *values])


def one_meaning(container: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of ``add_argument`` with their action made a :class:`OneMeaning` one (``container``: the parser or
    argument group it is added to, whose registry names the actions)."""
    base = container._registry_get("action", options.get("action"), options.get("action"))
    return {**options, "action": type(f"OneMeaning{base.__name__}", (OneMeaning, base), {})}


def closest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> Optional[str]:
    """The candidate closest to a misspelt ``word`` (difflib's measure, at least ``cutoff``), or None when none is
    close: what a refusal suggests ("did you mean ...?")."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return match[0] if match else None


def closest_spelling(flag: str, options: Iterable[str]) -> Optional[str]:
    """The option closest to a misspelt ``flag``, '_' and '-' alike, close enough to mean the same (difflib's
    measure at least :data:`FLAG_CUTOFF`: ``--batch-szie`` is ``--batch-size``, while ``--lr`` is no ``--lora-r``);
    None when none is."""
    options = list(options)
    match = closest(flag.replace("_", "-"), {option.replace("_", "-") for option in options}, FLAG_CUTOFF)
    spellings = [option for option in options if option.replace("_", "-") == match]
    return closest(flag, spellings, 0.0) if spellings else None  # the spelling nearer the typed one: --n_docs


def flags_as_typed(parser: argparse.ArgumentParser, names: Mapping[str, str], typed: Iterable[str]) -> dict[str, str]:
    """``names`` (a shared code's flag -> a script's spelling of it, for :func:`~dpr_gc.base.errors.flags_renamed`)
    with each spelling replaced by the one the user typed of the same option (an alias of it in ``parser``, or of
    the shared flag), so that messages name flags as typed: ``--n-docs`` where ``--n-docs`` was typed, not
    ``--n_docs``."""
    typed = set(typed)
    out = {}
    for flag, spelling in names.items():
        options = [o for action in parser._actions if {flag, spelling} & set(action.option_strings)
                   for o in action.option_strings]
        out[flag] = next((o for o in options if o in typed), spelling)
    return out


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser that reports a bad command line as one ``error: ...`` line and exit status 2, and
    shows every option's default in ``--help``. A value that starts with '-' (``--memory-budget -5GB``) reads as a
    flag to argparse, which then says only "expected one argument"; the line says how to pass such a value. A
    misspelt flag, command or choice is named with the closest one (``did you mean --batch-size?``). Under torchrun
    each machine's first rank prints the line (:meth:`error`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs["exit_on_error"] = False  # parse_known_args catches the errors, to explain them (see dash_value)
        super().__init__(*args, **kwargs)
        # another tool's flag name -> (whose name, the flag taking it here) (see foreign_hints)
        self.foreign_names: dict[str, tuple[str, str]] = {}
        self.dpr_script = ""  # the DPR-compatible script taking this command's DPR command lines, if any
        self.outer: Optional[ArgumentParser] = None  # the parser this one is a sub-command of (see outer_hint)

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else list(args)
        self.given = args
        self.set_by: dict[str, tuple[Any, Optional[str]]] = {}  # see OneMeaning
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            self.error(self.dash_value(e, args) or self.as_typed(e, args))

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self.command_parser(parsed)
            parser.error(gettext("unrecognized arguments: %s") % " ".join(extras) + parser.closest_flag(extras))
        return parsed

    def command_parser(self, parsed: argparse.Namespace) -> "ArgumentParser":
        """The parser of the sub-command ``parsed`` names, whose flags an unrecognised one was meant to be; this
        parser where there is none."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                chosen = action.choices[getattr(parsed, action.dest)]
                return chosen if isinstance(chosen, ArgumentParser) else self
        return self

    def closest_flag(self, words: Sequence[str]) -> str:
        """A hint for each flag among ``words`` (each unknown word, so several unknown flags are answered at once),
        in their order: what this command calls another tool's flag name (:meth:`foreign_hints`: ``--model_file is
        DPR's name: ...``, ``--lr is sentence-transformers' name: ...``), where an option of the command line
        before the sub-command goes (:meth:`outer_hint`), or the option close to it (``did you mean --FLAG?``);
        the GC-DPR/DPR flags this command has no flag for are named together with its script, last; '' for none."""
        flags = dict.fromkeys(word.split("=", 1)[0] for word in words if word[:1] == "-")
        foreign = self.foreign_hints(list(flags))
        hints = []
        for flag in flags:
            match = None if flag in foreign else self.closest_option(flag)
            hints.append(foreign.get(flag) or self.outer_hint(flag) or (f"did you mean {match}?" if match else None))
        return "".join(f"; {hint}" for hint in [*hints, foreign.get("")] if hint)

    def outer_hint(self, word: str) -> Optional[str]:
        """Where ``word`` goes when it is an option of the parser this one is a sub-command of (``dpr-gc -v train``,
        not ``dpr-gc train -v``); None otherwise."""
        flag, outer = word.split("=", 1)[0], self.outer
        if outer is None or flag in ("-h", "--help") or flag not in outer._option_string_actions:
            return None
        command = self.prog.removeprefix(outer.prog).strip()
        return f"{flag} is {outer.prog}'s own option: put it before the command, {outer.prog} {flag} {command} ..."

    def foreign_target(self, flag: str) -> Optional[str]:
        """The flag of this command ``foreign_names`` answers another tool's ``flag`` with (the first of its
        alternatives this command has, with its note), or None where it names none this command has."""
        target = self.foreign_names[flag][1] if flag in self.foreign_names else ""
        return next((t for t in target.split("|") if t and t.split()[0] in self._option_string_actions), None)

    def foreign_hints(self, flags: Sequence[str]) -> dict[str, str]:
        """What this command calls each of ``flags`` that is another tool's name (``foreign_names``), by flag:
        ``--lr is sentence-transformers' name: dpr-gc train takes --learning-rate``; the GC-DPR/DPR flags it has no
        flag for are named together with the script that takes DPR's command lines (``dpr_script``), under ''."""
        hints = {flag: f"{flag} is {self.foreign_names[flag][0]} name: {self.prog} takes {self.foreign_target(flag)}"
                 for flag in flags if self.foreign_target(flag)}
        scripted = [flag for flag in flags if flag not in hints and self.foreign_names.get(flag, ("",))[0] == "DPR's"]
        if scripted and self.dpr_script:
            which = f"{scripted[0]} is a GC-DPR/DPR flag" if len(scripted) == 1 else \
                f"{', '.join(scripted)} are GC-DPR/DPR flags"
            hints.update(dict.fromkeys(scripted, ""))
            hints[""] = (f"{which} {self.prog} has no flag for; {self.dpr_script} takes DPR's whole command line "
                         "(docs/dpr.md)")
        return hints

    def hydra_switch(self, key: str, value: str) -> Optional[list[str]]:
        """The flags a hydra override ``key=value`` stands for when ``--key`` is a switch of this parser (a flag that
        takes no value, as DPR's booleans): ``[--key]`` for true/True/1, ``[]`` for false/False/0, any other value
        refused in one line naming ``key=value``; None where ``--key`` is no switch (its value is the flag's)."""
        action = self._option_string_actions.get(f"--{key}")
        if action is None or action.nargs != 0:
            return None
        if value.lower() in ("true", "1"):
            return [f"--{key}"]
        if value.lower() in ("false", "0"):
            return []
        self.error(f"{key}={value}: --{key} is a switch; give {key}=true (or True, 1) to set it, {key}=false "
                   "(or False, 0) to leave it off")

    def closest_option(self, word: str) -> Optional[str]:
        """This parser's option closest to ``word`` (a flag, with or without ``=VALUE``), if one is close."""
        return closest_spelling(word.split("=", 1)[0], self._option_string_actions) if word[:1] == "-" else None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a value against ``choices`` (a sub-command's name among them), naming the closest
        choice when there is one."""
        missing = action.choices is not None and value not in action.choices
        match = closest(str(value), map(str, action.choices)) if missing else None
        if match is not None:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, gettext("invalid choice: %(value)r (choose from %(choices)s)")
                                         % {"value": value, "choices": choices} + f"; did you mean {match!r}?")
        super()._check_value(action, value)

    def _get_option_tuples(self, option_string: str) -> list:
        """argparse's matches of an abbreviated flag, one per flag: ``--learning`` matches ``--learning-rate`` and
        its alias ``--learning_rate``, one flag, which argparse refused as ambiguous. A hidden flag (an old alias
        ``--help`` does not show) is matched spelt out only: ``--fp`` is no ``--fp16``, and ``--grad`` is
        ``--gradient-checkpointing``, not ambiguous with ``--grad_cache``."""
        matches = [m for m in super()._get_option_tuples(option_string) if m[0].help != argparse.SUPPRESS]
        return [match for i, match in enumerate(matches) if all(match[0] is not m[0] for m in matches[:i])]

    def abbreviable(self) -> list[str]:
        """The option strings a unique prefix may stand for: those of the flags ``--help`` shows."""
        return [option for option, action in self._option_string_actions.items() if action.help != argparse.SUPPRESS]

    def dash_value(self, error: argparse.ArgumentError, args: Sequence[str]) -> Optional[str]:
        """Why ``error`` arose, when it is a one-value flag followed by a word that starts with '-' but is none of
        this parser's options (argparse takes any such word but a plain negative number for an unknown flag)."""
        if error.message != gettext("expected one argument"):  # argparse's own words, translated as it does
            return None
        for flag, value in zip(args, args[1:]):
            if flag == "--":
                return None
            action = self._option_string_actions.get(flag)
            if (action is None or action.nargs is not None or value[:1] not in self.prefix_chars
                    or error.argument_name != "/".join(action.option_strings) or self.names_an_option(value)):
                continue
            return (f"argument {flag}: its value {value!r} starts with '-', so it was read as a flag; write "
                    f"{flag}={value} if that value is meant")
        return None

    def as_typed(self, error: argparse.ArgumentError, args: Sequence[str]) -> str:
        """``error``'s message naming its flag by the spelling typed in ``args`` (``argument --n_docs: ...``), not by
        all of the flag's spellings as argparse does (``argument --n-docs/--n_docs: ...``)."""
        spellings = (error.argument_name or "").split("/")
        typed = dict.fromkeys(word.split("=", 1)[0] for word in args if word.split("=", 1)[0] in spellings)
        if len(spellings) < 2 or not typed:
            return str(error)
        return str(error).replace(f"argument {error.argument_name}:", f"argument {'/'.join(typed)}:", 1)

    def names_an_option(self, word: str) -> bool:
        """Whether argparse reads ``word`` as one of this parser's options (exactly, with ``=VALUE``, or, where
        abbreviations are allowed, as the start of a long option)."""
        option = word.split("=", 1)[0]
        return option in self._option_string_actions or (
            self.allow_abbrev and option[:2] == "--" and any(name.startswith(option) for name in self.abbreviable()))

    def print_help(self, file: Any = None) -> None:
        """The help, printed by each machine's first rank only under torchrun (every rank parses the same line)."""
        if not shown_by_another_rank():
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one ``error:`` line and exit 2; under torchrun every rank parses the same command
        line, so only each machine's first rank prints it (the others exit 2 silently)."""
        if shown_by_another_rank():
            sys.exit(ERROR_EXIT)
        say(f"error: {self.prog}: {self.misspelt_first(message)} (see {self.prog} --help)")
        sys.exit(ERROR_EXIT)

    def misspelt_first(self, message: str) -> str:
        """``message``, led by the flags given that this parser does not know (with the closest one) when it says
        required flags are missing: argparse names the missing ones first, so ``dpr-gc train --batch-szie 4`` never
        heard of its misspelling."""
        if not message.startswith(gettext("the following arguments are required: %s").split("%s")[0]):
            return message
        unknown = self.unknown_words(getattr(self, "given", ()))
        if not unknown:
            return message
        return gettext("unrecognized arguments: %s") % " ".join(unknown) + self.closest_flag(unknown) + "; " + message

    def unknown_words(self, given: Sequence[str]) -> list[str]:
        """The flags in ``given`` this parser does not know, each with the values after it (the words up to the next
        flag), as argparse lists them: ``--batch-szie 4``, not ``--batch-szie``."""
        words: list[str] = []
        taking = False
        for word in given:
            if word == "--":
                break
            if word[:1] in self.prefix_chars and not self._negative_number_matcher.match(word):
                unknown = self.unknown_option(word)
                words += [word] if unknown else []
                taking = unknown and "=" not in word
            elif taking:
                words.append(word)
        return words

    def unknown_option(self, word: str) -> bool:
        """Whether ``word`` (``--flag`` or ``--flag=VALUE``) is none of this parser's options, nor a prefix of a shown
        one; a single-dash word (``-v``, ``-n5``), whether its first letter is none of this parser's short options."""
        flag = word.split("=", 1)[0]
        if flag[:2] != "--":
            return flag != "-" and flag[:2] not in self._option_string_actions
        return flag != "--" and flag not in self._option_string_actions and not any(
            option.startswith(flag) for option in self.abbreviable())


def _number(kind: Callable[[str], Any], test: Callable[[Any], bool], need: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {need}") from None
        if isinstance(value, float) and not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {need}")
        return value

    def accepts(value: Any) -> bool:
        """The same rule for a value given in code (see :func:`dpr_gc.base.settings.check`): any integer type but
        bool (``numpy.int64`` too), and where a number goes any finite real (``numpy.float32`` too)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real if kind is float else numbers.Integral):
            return False
        return (isinstance(value, numbers.Integral) or math.isfinite(value)) and bool(test(value))

    def plain(value: Any) -> Any:
        """An accepted value as Python's own int or float (a record holds it as JSON)."""
        return value if type(value) in (int, float) else kind(value)

    parse.__name__ = need
    parse.accepts = accepts  # type: ignore[attr-defined]
    parse.plain = plain  # type: ignore[attr-defined]
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a positive number")
nonnegative_float = _number(float, lambda v: v >= 0, "a number >= 0")
any_float = _number(float, lambda v: True, "a finite number")
any_int = _number(int, lambda v: True, "an integer")
unit_float = _number(float, lambda v: 0 <= v <= 1, "a number from 0 to 1")
SEED_MAX = 2 ** 32 - 1  # numpy takes no larger seed (train, verify and demo seed it; every --seed takes the same)
seed_int = _number(int, lambda v: 0 <= v <= SEED_MAX, f"an integer from 0 to {SEED_MAX} (2**32 - 1)")
proper_fraction = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")  # AdamW's betas
SIZE_MAX = 65_536  # a layer width (--projection-dim, --lora-r): wider than any model's; more only exhausts memory
layer_size = _number(int, lambda v: 1 <= v <= SIZE_MAX, f"an integer from 1 to {SIZE_MAX}")


def auto_or(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag type taking ``auto`` or a value of the flag type ``kind`` (a :func:`_number` one); a word that is
    neither is refused naming both, and auto where the word is close to it (``atuo``)."""
    def parse(text: str) -> Any:
        if text == "auto":
            return text
        try:
            return kind(text)
        except argparse.ArgumentTypeError:
            hint = "; did you mean auto?" if closest(text.lower(), ["auto"]) else ""
            raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor {kind.__name__}{hint}") from None

    parse.__name__ = f"auto or {kind.__name__}"
    return parse


def split_refusal(value: Any) -> Optional[str]:
    """Why ``value`` is no BEIR qrels split (the SPLIT of ``qrels/SPLIT.tsv``); None when it is one. The rule of
    :func:`qrels_split`, for a value given in code as well."""
    if not isinstance(value, str):
        return f"{value!r} is not a split name (a str: train, dev, test)"
    if not value.strip():
        return "the split is empty; give the qrels split to read (qrels/SPLIT.tsv), e.g. train, dev or test"
    return None


def qrels_split(text: str) -> str:
    """A flag type for a BEIR qrels split: any name but an empty one (see :func:`split_refusal`)."""
    why = split_refusal(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


qrels_split.refusal = split_refusal  # type: ignore[attr-defined]


def int_between(low: int, high: int) -> Callable[[str], int]:
    """A flag type for an integer in ``[low, high]``: the range a library (FAISS) can take without crashing."""
    return _number(int, lambda v: low <= v <= high, f"an integer from {low} to {high}")


def home_expanded(text: str) -> str:
    """A path flag's value with a leading ``~`` or ``~user`` expanded, as the shell would: it leaves one after ``=``
    (``--output=~/x``) or inside quotes, which would otherwise make a folder named ``~``."""
    return os.path.expanduser(text)


home_expanded.text = True  # type: ignore[attr-defined]  # a path: a value given in code must be a str


def _output_path(check: Callable[[str, str], Any], name: str, beside: int = 0) -> Callable[[str], str]:
    """A path flag type: :func:`home_expanded`, then ``check`` (from ``files``, or a folder to read's) while the
    command line is parsed; an output's name leaves room for the ``beside`` bytes of the files written beside it."""
    def parse(text: str) -> str:
        path = home_expanded(text)
        try:
            check_path_length(path, "path", beside)
            check(path, "path")
        except DprGcError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return path

    parse.__name__ = name
    parse.text = True  # type: ignore[attr-defined]  # a path: a value given in code must be a str (settings.check)
    return parse


def _check_input_dir(text: str, flag: str) -> None:
    """Refuse a folder to read that is a file or lies under one; a missing one is named by the stage reading it,
    which says what it should hold."""
    for q in (Path(text), *Path(text).parents):
        if q.exists():
            if not q.is_dir():
                raise DprGcError(f"{flag} {text}: {q} is a file, not a folder; give a folder")
            return


# A folder to read (retrieve's --index): not an existing file, nor under one.
input_dir = _output_path(_check_input_dir, "input_dir")
# A file to write: not an existing folder, not under a file (an existing file is replaced atomically).
output_file = _output_path(check_output_file, "output_file", BESIDE_BYTES)
# A folder to write into: not an existing file, nor under one (also ``--cache-dir``, as in ``$DPR_GC_CACHE``).
output_dir = _output_path(check_output_dir, "output_dir", BESIDE_BYTES)


# The image formats a plot is written in, by the file name's suffix.
PLOT_FORMATS = ("png", "pdf", "svg")


def plot_format(path: str) -> str:
    """The format of a plot written to ``path``, from its suffix (one of :data:`PLOT_FORMATS`)."""
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise DprGcError(f"path {path}: a plot is written as {', '.join(PLOT_FORMATS)}; give a name ending in "
                         f".{' or .'.join(PLOT_FORMATS)}")
    return suffix


def _check_plot_file(text: str, flag: str) -> None:
    check_output_file(text, flag)
    plot_format(text)


# A plot to write: an output file whose name ends in a format matplotlib writes (see :func:`plot_format`).
plot_file = _output_path(_check_plot_file, "plot_file")


def device_refusal(value: Any) -> Optional[str]:
    """Why ``value`` is no torch device of this machine (``cpu``, ``cuda``, ``cuda:N`` below the GPU count,
    ``mps``); None when it is one. ``--device``'s rule, for a value given in code as well."""
    import torch

    try:
        device = torch.device(value) if isinstance(value, str) else None
    except (RuntimeError, ValueError):
        device = None
    if device is None:
        return f"{value!r} is not a torch device (use cpu, cuda or cuda:N)"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"{value!r}: no CUDA GPU is available here; use --device cpu"
        if device.index is not None and device.index >= count:
            return f"{value!r}: this machine has {count} GPU(s) (cuda:0..cuda:{count - 1})"
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return f"{value!r}: MPS is not available here; use --device cpu"
    elif device.type not in ("cpu", "cuda", "mps"):
        return f"{value!r}: unsupported device type; use cpu or cuda[:N]"
    return None


def device_arg(text: str) -> str:
    """A torch device that exists on this machine (see :func:`device_refusal`, which also checks a value given in
    code: :func:`dpr_gc.base.settings.check`)."""
    why = device_refusal(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


device_arg.refusal = device_refusal  # type: ignore[attr-defined]
