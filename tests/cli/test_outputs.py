"""The commands' shared outputs: ``--json [PATH]`` of provision and publish (stdout when bare,
a file otherwise) and one clear error, exit 2, for a path that cannot be written."""

import json

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.cli import main
from deltarec.cli.common import write_output
from deltarec.errors import BadInputError
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=4, num_embeddings=100)}


@pytest.fixture
def location(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "ctr", TABLES, world_size=1)
    write_dump(root, info, 0, {T: {0: random_rows(range(5), TABLES[T])}}, kind=DumpKind.SNAPSHOT)
    return ["--artifacts", root.uri, "--run", "ctr", "--store", f"sqlite:///{tmp_path / 's.db'}"]


@pytest.mark.parametrize("command", ["provision", "publish"])
def test_json_result_goes_to_the_path_given_and_nothing_json_to_stdout(
    command, location, tmp_path, capsys
):
    if command == "publish":
        assert main(["provision", *location]) == 0
    out = tmp_path / "out" / "result.json"
    out.parent.mkdir()
    assert main([command, *location, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["run"] == "ctr" and result["generation"] == 1
    assert out.read_text().endswith("}\n")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("command", ["provision", "publish"])
def test_json_result_to_an_unwritable_path_exits_2_naming_it(command, location, tmp_path, capsys):
    if command == "publish":
        assert main(["provision", *location]) == 0
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "result.json"  # under a file: no directory can hold it
    assert main([command, *location, "--json", str(path)]) == 2
    assert f"cannot write {path}" in capsys.readouterr().err


def test_write_output_writes_dash_to_stdout(capsys):
    write_output("-", "text\n")
    assert capsys.readouterr().out == "text\n"
    with pytest.raises(BadInputError, match="cannot write"):
        write_output("/proc/no/such/dir/x.json", "{}")
