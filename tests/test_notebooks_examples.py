"""The worked examples in notebooks/ run end to end through a real gateway.

Each notebook is copied into an agent's user-files/ and run with run-all over
the control socket, in a real bwrap'd ipykernel, with outputs saved.  The
expected numbers are computed here, independently, from the same CSV.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import nbformat
import pytest


pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
AGENT = "analyst"
ARTIFACT_MIME = "application/vnd.kernel-gateway.artifact+json"


GATEWAY_AGENTS = (AGENT,)


@pytest.fixture(scope="module", autouse=True)
def examples_in_the_agents_tree(gw):
    shutil.copytree(NOTEBOOKS, os.path.join(gw.root, AGENT, "user-files", "notebooks"))


def run_all(gw, name: str) -> tuple[dict, nbformat.NotebookNode]:
    """Run a notebook through the gateway; return the result and the saved notebook."""
    path = f"user-files/notebooks/{name}"
    status, result = gw.client.call(
        "POST", f"/v1/agents/{AGENT}/notebooks/{path}/run-all", {"save_outputs": True, "timeout": 120}, timeout=300
    )
    assert status == 200, result
    saved = nbformat.read(os.path.join(gw.root, AGENT, path), as_version=4)
    return result, saved


def expected_summary() -> tuple[pd.DataFrame, str]:
    """Revenue per product per quarter, cleaned by the rules the notebooks state, computed here."""
    raw = pd.read_csv(NOTEBOOKS / "data" / "sales.csv")
    raw["region"] = raw["region"].str.strip()
    rows = raw.drop_duplicates().dropna(subset=["units"]).copy()
    rows["units"] = rows["units"].abs()
    list_price = {product: prices.dropna().iloc[0] for product, prices in rows.groupby("product")["unit_price"]}
    rows["unit_price"] = rows["unit_price"].fillna(rows["product"].map(list_price))
    rows["revenue"] = rows["units"] * rows["unit_price"]
    rows["quarter"] = ["Q1" if int(date[5:7]) <= 3 else "Q2" for date in rows["date"]]
    table = rows.groupby(["product", "quarter"])["revenue"].sum().unstack()
    table["change"] = table["Q2"] - table["Q1"]
    return table, table["change"].idxmax()


def test_repo_notebooks_are_clean_nbformat_45():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        assert (notebook.nbformat, notebook.nbformat_minor) == (4, 5), path.name
        ids = [cell.id for cell in notebook.cells]
        assert all(ids) and len(set(ids)) == len(ids), path.name
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.id)
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} >= {"dataframe-inspection.ipynb", "iterative-exploration.ipynb"}


def test_dataframe_inspection_runs_and_saves_a_png_artifact(gw):
    result, saved = run_all(gw, "dataframe-inspection.ipynb")
    assert result["status"] == "ok" and result["stopped_at"] is None, result
    assert result["saved"] is True, result["reason"]
    code_cells = [cell for cell in saved.cells if cell.cell_type == "code"]
    assert [c["cell_id"] for c in result["cells"]] == [cell.id for cell in code_cells]
    assert all(c["status"] == "ok" for c in result["cells"]), result["cells"]
    nbformat.validate(saved)

    by_id = {c["cell_id"]: c for c in result["cells"]}
    # the raw data's faults are found, and cleaning removes exactly the two bad rows
    assert "duplicated rows: 1" in by_id["inspect-raw"]["text"]
    assert "negative units: 1" in by_id["inspect-raw"]["text"]
    assert "55 raw rows -> 53 clean rows" in by_id["clean"]["text"]

    # The figure is saved inline (so JupyterLab shows it) and was written by
    # the gateway as a PNG artifact file in the notebook session's outputs.
    plot = next(cell for cell in code_cells if cell.id == "plot")
    figures = [o for o in plot.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(figures) == 1, [o.output_type for o in plot.outputs]
    assert ARTIFACT_MIME not in figures[0].data
    png = base64.b64decode(figures[0].data["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert plot.execution_count == by_id["plot"]["execution_count"]
    agent_root = Path(gw.root, AGENT)
    artifacts = list(agent_root.glob(f"sessions/*/outputs/cell-{plot.execution_count}-*.png"))
    assert [a.read_bytes() for a in artifacts] == [png]


def test_iterative_exploration_reuses_state_and_ends_with_the_summary(gw):
    result, saved = run_all(gw, "iterative-exploration.ipynb")
    assert result["status"] == "ok" and result["saved"] is True, result
    assert all(c["status"] == "ok" for c in result["cells"]), result["cells"]
    nbformat.validate(saved)
    counts = [c["execution_count"] for c in result["cells"]]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)  # one kernel, top to bottom

    table, driver = expected_summary()
    by_id = {c["cell_id"]: c for c in result["cells"]}
    assert "best seller by units: Widget" in by_id["hypothesis"]["text"]
    assert f"largest contributor to growth: {driver}" in by_id["refine"]["text"]
    assert f"{driver} grows in every region: True" in by_id["regions"]["text"]

    summary = result["cells"][-1]
    assert summary["cell_id"] == "summary"
    lines = summary["text"].splitlines()
    for product, row in table.iterrows():
        line = next(line for line in lines if line.split()[:1] == [product])
        assert line.split()[1:4] == [f"{row['Q1']:.2f}", f"{row['Q2']:.2f}", f"{row['change']:.2f}"], line
    share = table.loc[driver, "change"] / table["change"].sum()
    assert lines[-1] == f"driver: {driver} ({share:.0%} of the Q1 -> Q2 growth)"
    # saved to disk as the kernel printed it
    saved_summary = next(cell for cell in saved.cells if cell.id == "summary")
    assert "".join(o.get("text", "") for o in saved_summary.outputs) == summary["text"]
