"""The examples of the docs and the README are what the code accepts, as shown.

Every fenced block of README.md and docs/**/*.md is found with markdown-it-py (CommonMark, as
the site renders it) and checked by its language; a block without one fails.

- `yaml`: every document parses. Each TrainingJob is validated by `jaxps_operator.schema.load`,
  the code `jaxps validate` runs: the CRD's schema and CEL rules, then what the runtime refuses
  in `spec.training` and in the templates' settings. A `--8<-- "FILE"` line (pymdownx.snippets,
  how a page shows a file of the repository) stands for that file, which must exist.
- `json`: parses.
- `python`: compiles, then runs (its functions defined, not called unless the block calls
  them), unless an HTML comment `<!-- not run: WHY -->` stands right before it; then only its
  imports run. Either way, every `name.attribute` it reads from a name it imported must exist.
  A block that is a snippet of a file is compiled (the file's own tests run it).
- `bash`: `bash -n` accepts it, and each command in it is one this test knows and checks
  (`VAR=value` prefixes, `\\` continuations and comments as bash reads them; `.venv/bin/`
  dropped):
  - `jaxps ...`: parsed by the `jaxps` parser; the files of `validate` and `local` exist and
    are valid TrainingJobs, and `local`'s `--kill` and `--scale` are parsed against that job,
    as `jaxps local` does before it starts;
  - `kubectl jaxps ...`: parsed by `kubectl jaxps`' parser;
  - `python -m jaxps_runtime ...`: parsed by the runtime's parser, then its TF1 flags by
    `cluster.parse_tf1_flags`, which leaves nothing unparsed;
  - `python FILE ...`: FILE exists, and its arguments parse with a parser made from FILE's own
    `add_argument` calls (read from its source: importing the benches would start JAX);
  - `make TARGET ... VAR=value`: targets and variables the Makefile defines;
  - `helm install|upgrade NAME CHART`: CHART exists and each `--set` key is in its values.yaml;
  - `kubectl ... -f FILE`, `docker build -f FILE`: FILE exists when it names a path of the
    repository (a file the page asks you to write is not checked);
  - a few others that need no check (`export`, `tensorboard`, `read`, `wait`, loop keywords).
- `text`: not checked.

Also: README.md is at most 250 lines and its set-up block holds exactly `make run` and
`make test`; no page names a commit by its hash.

The parsers are the ones the commands run, taken by `hack/docs_reference.py` as the reference
page takes them. Nothing is started: no job, no cluster, no subprocess but `bash -n`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from markdown_it import MarkdownIt

from jaxps_operator import kube, local, reconcile, schema
from jaxps_operator.policy import schedule
from jaxps_runtime.config import cluster
from jaxps_runtime.config.training import FINAL_EXITS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
NOT_RUN = re.compile(r"^<!-- not run: .+ -->$")
# a word of 7 to 40 hex digits with at least one letter and one digit: a commit's hash
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
UNCHECKED = {"export", "tensorboard", "read", "wait", "for", "do", "done", "source", "cd"}
LANGUAGES = {"yaml", "json", "python", "bash", "text"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str
    run: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def snippet(self) -> Path | None:
        """The file this block shows, when it is a snippet line."""
        match = SNIPPET.match(self.text.strip())
        return ROOT / match[1] if match else None


def blocks() -> Iterator[Block]:
    parser = MarkdownIt("commonmark")
    for page in PAGES:
        tokens = parser.parse(page.read_text())
        for i, token in enumerate(tokens):
            if token.type != "fence":
                continue
            before = tokens[i - 1] if i else None
            marked = (
                before is not None
                and before.type == "html_block"
                and NOT_RUN.match(before.content.strip()) is not None
            )
            line = (token.map or [0])[0] + 1
            language = token.info.split()[0] if token.info.strip() else ""
            yield Block(page, line, language, token.content, run=not marked)


ALL = list(blocks())


def of(language: str) -> list[Any]:
    return [pytest.param(b, id=b.id) for b in ALL if b.language == language]


def text_of(block: Block) -> str:
    """The block's text, or the file it is a snippet of."""
    path = block.snippet()
    if path is None:
        return block.text
    assert path.is_file(), f"{block.id}: the snippet's file {path.relative_to(ROOT)} is missing"
    return path.read_text()


# --- every block -------------------------------------------------------------------------------


def test_there_are_blocks_of_every_checked_language() -> None:
    assert {b.language for b in ALL} >= {"yaml", "python", "bash"}


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ALL])
def test_a_block_names_a_language_this_test_knows(block: Block) -> None:
    assert block.language in LANGUAGES, (
        f"{block.id}: a fence with language {block.language!r}; use one of {sorted(LANGUAGES)}"
    )


# --- yaml and json -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", of("yaml"))
def test_every_manifest_is_valid_as_jaxps_validate_says(block: Block) -> None:
    documents = [d for d in yaml.safe_load_all(text_of(block)) if d is not None]
    assert documents, f"{block.id}: no YAML document"
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == "TrainingJob":
            try:
                schema.load(yaml.safe_dump(document))
            except schema.InvalidManifestError as err:
                problems = "; ".join(map(str, err.problems))
                pytest.fail(f"{block.id}: invalid TrainingJob: {problems}")


@pytest.mark.parametrize("block", of("json"))
def test_every_json_block_parses(block: Block) -> None:
    json.loads(block.text)


def test_the_manifests_shown_include_the_examples() -> None:
    shown = {b.snippet() for b in ALL if b.language == "yaml"}
    assert ROOT / "examples" / "mnist.yaml" in shown


# --- python ------------------------------------------------------------------------------------


def _imports(tree: ast.Module) -> ast.Module:
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    return ast.Module(body=body, type_ignores=[])


def _attributes_found(tree: ast.Module, names: dict[str, Any], where: str) -> None:
    imported = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
            and node.value.id in names
        ):
            owner = names[node.value.id]
            assert hasattr(owner, node.attr), f"{where}: {node.value.id}.{node.attr} does not exist"


@pytest.mark.parametrize("block", of("python"))
def test_every_python_example_compiles_and_runs(block: Block) -> None:
    path = block.snippet()
    if path is not None:  # a file of the repository, whose own tests run it
        compile(text_of(block), str(path), "exec")
        return
    tree = ast.parse(block.text, filename=block.id)
    names: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(tree if block.run else _imports(tree), block.id, "exec"), names)
    _attributes_found(tree, names, block.id)


# --- shell -------------------------------------------------------------------------------------


def _logical_lines(text: str) -> Iterator[str]:
    """Lines as bash reads them: `\\` continuations joined, quotes spanning lines kept."""
    pending = ""
    for raw in text.splitlines():
        pending = f"{pending}\n{raw}" if pending else raw
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quotation still open
            continue
        yield pending
        pending = ""
    assert not pending, f"unfinished line: {pending!r}"


def commands(text: str) -> Iterator[list[str]]:
    """Each simple command of a block, without its `VAR=value` prefixes."""
    for line in _logical_lines(text):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word in SEPARATORS:
                while command and ENV_ASSIGNMENT.match(command[0]):
                    command.pop(0)
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def _docs_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "hack" / "docs_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)  # a script, not a package: loaded by path
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = _docs_reference().parsers()
    return found


def parse(parser: argparse.ArgumentParser, args: list[str], where: str) -> argparse.Namespace:
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {parser.prog} refuses {shlex.join(args)} (its error is above)")


def _manifest(path: str, where: str) -> dict[str, Any]:
    file = ROOT / path
    assert file.is_file(), f"{where}: {path} does not exist"
    try:
        return schema.load(file.read_text())
    except schema.InvalidManifestError as err:
        pytest.fail(f"{where}: {path} is no valid TrainingJob: {err.problems}")


def check_jaxps(args: list[str], where: str) -> None:
    parsed = parse(parsers()["jaxps"], args, where)
    if parsed.command == "validate":
        for path in parsed.files:
            _manifest(str(path), where)
    elif parsed.command == "local":
        job = _manifest(str(parsed.file), where)
        try:
            for kill in parsed.kill:
                local.Kill.parse(kill, job=job)
            for scale in parsed.scale:
                local.Scale.parse(scale, job=job)
        except (local.KillSpecError, local.ScaleSpecError) as err:
            pytest.fail(f"{where}: jaxps local would refuse it: {err}")


def check_runtime(args: list[str], where: str) -> None:
    runtime = parsers()["python -m jaxps_runtime"]
    try:
        _, rest = runtime.parse_known_args(args)
    except SystemExit:
        pytest.fail(f"{where}: python -m jaxps_runtime refuses {shlex.join(args)}")
    if rest:
        try:
            _, left = cluster.parse_tf1_flags(rest)
        except cluster.ClusterSpecError as err:
            pytest.fail(f"{where}: {err}")
        assert not left, f"{where}: python -m jaxps_runtime does not take {left}"


def _literal(node: ast.expr) -> Any:
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "argparse"
    ):
        return getattr(argparse, node.attr)
    return ast.literal_eval(node)


@functools.cache
def script_parser(path: Path) -> argparse.ArgumentParser:
    """A parser with the arguments `path` declares (`add_argument` calls of literal names;
    types, defaults and non-literal choices left out: every value is taken as text)."""
    parser = argparse.ArgumentParser(prog=str(path.relative_to(ROOT)))
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            continue
        names = [ast.literal_eval(a) for a in node.args]
        kwargs = {}
        for keyword in node.keywords:
            if keyword.arg in ("action", "nargs", "dest", "required", "choices"):
                try:
                    kwargs[keyword.arg] = _literal(keyword.value)
                except ValueError:  # choices=sorted(CASES): any value
                    continue
        parser.add_argument(*names, **kwargs)
    return parser


def check_python(args: list[str], where: str) -> None:
    if args[:2] == ["-m", "jaxps_runtime"]:
        check_runtime(args[2:], where)
        return
    if args[:1] == ["-c"]:
        return
    assert args, f"{where}: python without a script"
    script = ROOT / args[0]
    assert script.is_file(), f"{where}: {args[0]} does not exist"
    parse(script_parser(script), args[1:], where)


@functools.cache
def makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = {
        target
        for line in re.findall(r"^([A-Za-z0-9_.%$() -]+?):(?!=)", text, flags=re.M)
        for target in line.split()
    }
    variables = set(re.findall(r"^([A-Z_]+)\s*[:?]?=", text, flags=re.M))
    return targets, variables


def check_make(args: list[str], where: str) -> None:
    targets, variables = makefile()
    for arg in args:
        if "=" in arg:
            name = arg.split("=", 1)[0]
            assert name in variables, f"{where}: the Makefile has no variable {name}"
        else:
            assert arg in targets, f"{where}: the Makefile has no target {arg}"


def _repository_path(path: str, where: str) -> None:
    """A relative path into the repository must exist; another (a file the reader writes) is
    not checked."""
    if path == "-" or Path(path).is_absolute():
        return
    if (ROOT / Path(path).parts[0]).exists():
        assert (ROOT / path).exists(), f"{where}: {path} does not exist"


def check_helm(args: list[str], where: str) -> None:
    assert args[0] in ("install", "upgrade"), f"{where}: helm {args[0]} is not checked"
    positional = [a for a in args[1:] if not a.startswith("-")]
    flags = args[1:]
    # the values of -n and --set are not positional
    for flag in ("-n", "--namespace", "--set"):
        while flag in flags:
            i = flags.index(flag)
            if flags[i + 1] in positional:
                positional.remove(flags[i + 1])
            flags = flags[:i] + flags[i + 2 :]
    chart = ROOT / positional[1]
    assert (chart / "Chart.yaml").is_file(), f"{where}: no chart at {positional[1]}"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for i, arg in enumerate(args):
        if arg == "--set":
            for pair in args[i + 1].split(","):
                node = values
                name = pair.split("=", 1)[0]
                for key in name.split("."):
                    missing = not isinstance(node, dict) or key not in node
                    assert not missing, f"{where}: {positional[1]}/values.yaml has no {name}"
                    node = node[key]


def check_kubectl(args: list[str], where: str) -> None:
    if args[:1] == ["jaxps"]:
        parse(parsers()["kubectl jaxps"], args[1:], where)
        return
    for i, arg in enumerate(args):
        if arg == "-f":
            _repository_path(args[i + 1], where)


def check_docker(args: list[str], where: str) -> None:
    for i, arg in enumerate(args):
        if arg == "-f":
            _repository_path(args[i + 1], where)


CHECKS: dict[str, Callable[[list[str], str], None]] = {
    "jaxps": check_jaxps,
    "python": check_python,
    "python3": check_python,
    "make": check_make,
    "helm": check_helm,
    "kubectl": check_kubectl,
    "docker": check_docker,
}


@pytest.mark.parametrize("block", of("bash"))
def test_every_command_is_one_the_code_takes(block: Block) -> None:
    syntax = subprocess.run(
        ["bash", "-n"], input=block.text, capture_output=True, text=True, check=False
    )
    assert syntax.returncode == 0, f"{block.id}: bash -n: {syntax.stderr}"
    for command in commands(block.text):
        program = command[0].removeprefix(".venv/bin/")
        where = f"{block.id}: {shlex.join(command)}"
        if program in CHECKS:
            CHECKS[program](command[1:], where)
        else:
            assert program in UNCHECKED, f"{where}: {program} is a command this test does not know"


# --- the checks themselves fail ----------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        "jaxps locall examples/mnist.yaml",
        "jaxps local examples/mnist.yaml --kll ps-0@step=3",
        "jaxps local examples/mnist.yaml --kill ps-9@step=3",
        "jaxps local examples/mnist.yaml --scale worker=4@step=100",
        "jaxps validate examples/no-such.yaml",
        "kubectl jaxps top",
        "python bench/transport.py --no-such-flag",
        "python bench/no_such.py",
        "python -m jaxps_runtime --job_name=ps --task_index=0",
        "make no-such-target",
        "helm install jaxps charts/jaxps --set no.such=1",
        "kubectl apply -f examples/no-such.yaml",
        "jaxsp local examples/mnist.yaml",
    ],
)
def test_a_wrong_command_fails(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    block = Block(ROOT / "README.md", 0, "bash", command + "\n", run=True)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test_every_command_is_one_the_code_takes(block)
    capsys.readouterr()


def test_a_manifest_the_crd_refuses_fails() -> None:
    bad = "apiVersion: jaxps.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\nspec:\n"
    bad += "  replicaSpecs: {worker: {replicas: 1}}\n  training: {mode: sideways}\n"
    with pytest.raises(pytest.fail.Exception, match="mode"):
        test_every_manifest_is_valid_as_jaxps_validate_says(
            Block(ROOT / "README.md", 0, "yaml", bad, run=True)
        )


def test_a_python_example_that_names_what_does_not_exist_fails() -> None:
    code = "from jaxps.sdk import Client\n\nClient.no_such_method\n"
    with pytest.raises(AttributeError):
        test_every_python_example_compiles_and_runs(
            Block(ROOT / "README.md", 0, "python", code, run=True)
        )
    with pytest.raises(AssertionError, match="no_such_method"):
        test_every_python_example_compiles_and_runs(
            Block(ROOT / "README.md", 0, "python", code, run=False)
        )


# --- the README and every page -----------------------------------------------------------------


def test_the_readme_is_short_and_sets_up_with_two_commands() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    text = readme.read_text()
    section = text.split("## Set up", 1)[1]
    setup = next(b for b in ALL if b.page == readme and b.text in section)
    assert [c[:2] for c in commands(setup.text)] == [["make", "run"], ["make", "test"]]


@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PAGES])
def test_no_page_names_a_commit(page: Path) -> None:
    found = COMMIT.findall(page.read_text())
    assert not found, f"{page.relative_to(ROOT)} names commits {found}: say what, not when"


def _failure_reasons() -> set[str]:
    """Every reason a job can fail with that the code names: `status.finish(succeeded=False,
    reason="...")` anywhere in the operator, the final exits' reasons, the refusals' reasons,
    and the reasons a waiting pod's timeout fails the job with."""
    found = {*FINAL_EXITS.values(), *kube.KUBELET_WARNINGS.values()}
    found |= set(schedule.TIMEOUT_REASONS.values())
    found |= {reconcile.RefusedError.reason}
    found |= {c.reason for c in reconcile.RefusedError.__subclasses__()}
    for path in (ROOT / "operator" / "jaxps_operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "finish"
            ):
                continue
            words = {k.arg: k.value for k in node.keywords}
            failed = words.get("succeeded")
            reason = words.get("reason")
            if (
                isinstance(failed, ast.Constant)
                and failed.value is False
                and isinstance(reason, ast.Constant)
            ):
                found.add(str(reason.value))
    return found


def test_troubleshooting_covers_every_reason_a_job_fails_with() -> None:
    reasons = _failure_reasons()
    assert {"InvalidTraining", "OOMKilled", "DeadlineExceeded", "NameTaken"} <= reasons
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in page)
    assert not missing, f"docs/troubleshooting.md does not say what to do on {missing}"
