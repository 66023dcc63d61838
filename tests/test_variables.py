"""Variables of a real ipykernel: listed and previewed over the shell channel only.

The kernel holds DataFrames, arrays, big containers and hostile objects whose
``repr``/``len``/``__getattr__``/``__class__`` record the call and fail or
sleep; inspection must describe them without ever calling those.  Probes of the
kernel's state use ``user_expressions`` on a silent request, so they do not
disturb what they measure.
"""

from __future__ import annotations

import ast
import asyncio

import pytest
from jupyter_client.manager import AsyncKernelManager

from kernel_gateway.errors import GatewayError
from kernel_gateway.variables import list_variables, preview_variable

SETUP = r'''
import time
import numpy as np
import pandas as pd

touched = []  # every forbidden call on a hostile object lands here

class Hostile:
    def __repr__(self):
        touched.append("repr"); raise RuntimeError("repr called")
    def __str__(self):
        touched.append("str"); raise RuntimeError("str called")
    def __len__(self):
        touched.append("len"); raise RuntimeError("len called")
    def __getattr__(self, name):
        touched.append("getattr " + name); raise RuntimeError("getattr called")
    def __dir__(self):
        touched.append("dir"); raise RuntimeError("dir called")

class Sleepy:
    def __repr__(self):
        touched.append("sleepy repr"); time.sleep(600); return "late"

class HugeList(list):
    def __repr__(self):
        touched.append("huge repr"); return "x" * 100_000_000

class Liar:
    @property
    def __class__(self):
        touched.append("__class__"); return pd.DataFrame

df = pd.DataFrame({"city": ["Oslo", "Lima", "Pune"] * 400, "temp": np.arange(1200) / 10, "n": np.arange(1200)})
wide = pd.DataFrame(np.zeros((5, 300)))
matrix = np.arange(12.0).reshape(3, 4)
big_list = list(range(1_000_000))
settings = {"depth": 3, "name": "x", "frame": df}
text = "abc" * 10_000
answer = 42
huge_int = 10 ** 5000
hostile = Hostile()
hostile.label = "kept"
sleepy = Sleepy()
huge = HugeList(range(5))
liar = Liar()
_private = "hidden"
mean_temp = df["temp"].mean()
count_n = df["n"].sum()
is_wide = np.bool_(True)
twelve = pd.Series(range(12), name="n")
def helper(a, b=2):
    "Add things."
    return a + b
'''


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """(run, kc): a python3 kernel holding SETUP, and a runner for coroutines on its loop."""
    loop = asyncio.new_event_loop()
    km = AsyncKernelManager(kernel_name="python3")
    loop.run_until_complete(km.start_kernel(cwd=str(tmp_path_factory.mktemp("kernel-cwd"))))
    kc = km.client()
    kc.start_channels()
    try:
        loop.run_until_complete(kc.wait_for_ready(timeout=60))
        reply = loop.run_until_complete(kc.execute_interactive(SETUP, timeout=60, output_hook=lambda msg: None))
        assert reply["content"]["status"] == "ok", reply["content"]
        yield loop.run_until_complete, kc
    finally:
        kc.stop_channels()
        loop.run_until_complete(km.shutdown_kernel(now=True))
        loop.close()


def probe(kernel, expression: str):
    """The value of ``expression`` in the kernel, read without running a cell."""
    run, kc = kernel

    async def evaluate():
        msg_id = kc.execute("", silent=True, store_history=False, user_expressions={"probe": expression})
        reply = await kc._async_recv_reply(msg_id, timeout=30)
        result = reply["content"]["user_expressions"]["probe"]
        assert result["status"] == "ok", result
        return ast.literal_eval(result["data"]["text/plain"])

    return run(evaluate())


def kernel_state(kernel) -> tuple:
    return (
        probe(kernel, "sorted(get_ipython().user_ns)"),
        probe(kernel, "get_ipython().execution_count"),
        probe(kernel, "len(get_ipython().user_ns['In'])"),
        probe(kernel, "id(get_ipython().user_ns.get('_'))"),
    )


def by_name(listing: dict) -> dict:
    return {item["name"]: item for item in listing["variables"]}


def test_list_names_types_and_summaries(kernel):
    run, kc = kernel
    listing = run(list_variables(kc))
    variables = by_name(listing)
    assert listing["count"] == len(variables) and listing["truncated"] is False
    assert list(variables) == sorted(variables)
    assert variables["df"]["type"] == "DataFrame"
    assert variables["df"]["summary"].startswith("1200 rows × 3 columns; dtypes: 'city' ")
    assert "'temp' float64" in variables["df"]["summary"]
    assert variables["matrix"] == {"name": "matrix", "type": "ndarray", "summary": "shape (3, 4); dtype float64"}
    assert variables["big_list"]["summary"] == "length 1000000"
    assert variables["settings"]["summary"] == "length 3"
    assert variables["text"]["summary"].startswith("length 30000: 'abcabc")
    assert len(variables["text"]["summary"]) < 120
    assert variables["answer"]["summary"] == "42"
    assert variables["huge_int"]["summary"] == "<16610-bit int>"
    assert variables["helper"]["summary"] == "helper(a, b=2)"
    assert variables["hostile"] == {"name": "hostile", "type": "Hostile", "summary": "__main__.Hostile object"}
    assert variables["huge"]["summary"] == "length 5"
    assert variables["liar"]["type"] == "Liar"
    assert probe(kernel, "touched") == []


def test_list_hides_ipython_names_private_names_and_modules(kernel):
    run, kc = kernel
    names = set(by_name(run(list_variables(kc))))
    for hidden in ("In", "Out", "exit", "quit", "get_ipython", "open", "_", "_i", "_ih", "_private", "np", "pd", "time"):
        assert hidden not in names
    everything = set(by_name(run(list_variables(kc, include_private=True, limit=10_000))))
    assert {"_private", "np", "pd", "time"} <= everything
    assert not {"In", "Out", "exit", "quit", "get_ipython", "_ih", "_i", "__builtins__"} & everything


def test_numpy_scalars_show_their_values(kernel):
    run, kc = kernel
    variables = by_name(run(list_variables(kc, limit=10_000)))
    assert (variables["mean_temp"]["type"], variables["mean_temp"]["summary"]) == ("float64", "59.95")
    assert (variables["count_n"]["type"], variables["count_n"]["summary"]) == ("int64", "719400")
    assert variables["is_wide"]["summary"] == "True"
    assert run(preview_variable(kc, "mean_temp"))["preview"] == "59.95 (numpy float64)"


def test_a_series_preview_says_how_many_values_it_shows(kernel):
    run, kc = kernel
    text = run(preview_variable(kc, "twelve"))["preview"]
    assert text.startswith("Series 'n': length 12, dtype int64\n")
    assert text.endswith("\n[10 of 12 values shown]")
    assert run(preview_variable(kc, "df"))["preview"].count("first rows (10 of 1200 shown):") == 1


def test_modules_are_named_apart_unless_listed_with_include_private(kernel):
    run, kc = kernel
    listing = run(list_variables(kc, limit=10_000))
    assert {"np", "pd", "time"} <= set(listing["modules"])
    assert not {"np", "pd", "time"} & set(by_name(listing))
    assert "modules" not in run(list_variables(kc, include_private=True, limit=10_000))


def test_list_is_bounded(kernel):
    run, kc = kernel
    listing = run(list_variables(kc, limit=3))
    assert len(listing["variables"]) == 3
    assert listing["truncated"] is True and listing["count"] > 3


def test_preview_of_a_dataframe_shows_shape_dtypes_memory_and_first_rows(kernel):
    run, kc = kernel
    preview = run(preview_variable(kc, "df"))
    assert (preview["name"], preview["type"], preview["truncated"]) == ("df", "DataFrame", False)
    text = preview["preview"]
    assert text.startswith("DataFrame: 1200 rows × 3 columns\ndtypes:\n")
    assert "temp    float64" in text and "n         int64" in text
    assert "memory usage: " in text
    assert probe(kernel, "df.head(10).to_string()") in text


def test_preview_of_a_wide_dataframe_is_bounded(kernel):
    run, kc = kernel
    preview = run(preview_variable(kc, "wide"))
    assert preview["truncated"] is False
    assert "\n… 250 more columns\n" in preview["preview"]  # dtypes of the first 50 only
    assert "..." in preview["preview"].splitlines()[-1]  # and the table elides columns
    clipped = run(preview_variable(kc, "wide", max_chars=500))
    assert len(clipped["preview"]) == 500 and clipped["truncated"] is True


def test_preview_of_arrays_containers_strings_and_functions(kernel):
    run, kc = kernel
    matrix = run(preview_variable(kc, "matrix"))["preview"]
    assert matrix.startswith("ndarray: shape (3, 4), dtype float64, 96 bytes\n[[ 0.  1.  2.  3.]")
    big = run(preview_variable(kc, "big_list"))
    assert big["preview"].startswith("list, length 1000000\n[0] int 0\n[1] int 1\n")
    assert big["preview"].count("\n") == 50
    settings = run(preview_variable(kc, "settings"))["preview"]
    assert "'depth': int 3" in settings and "'frame': DataFrame 1200 rows × 3 columns" in settings
    text = run(preview_variable(kc, "text", max_chars=100))
    assert (text["preview"], text["truncated"]) == ("abc" * 33 + "a", True)
    assert run(preview_variable(kc, "helper"))["preview"] == "helper(a, b=2)\nAdd things."
    assert run(preview_variable(kc, "huge_int"))["preview"] == "<16610-bit int>"


def test_hostile_objects_are_never_repr_d(kernel):
    run, kc = kernel
    hostile = run(preview_variable(kc, "hostile"))
    assert hostile["preview"] == "__main__.Hostile object\n  .label: str length 4: 'kept'"
    assert run(preview_variable(kc, "sleepy"))["preview"] == "__main__.Sleepy object"
    huge = run(preview_variable(kc, "huge"))
    assert huge["preview"].startswith("HugeList, length 5\n[0] int 0")
    assert run(preview_variable(kc, "liar"))["type"] == "Liar"
    run(list_variables(kc, include_private=True, limit=10_000))
    assert probe(kernel, "touched") == []


def test_inspection_creates_no_names_and_keeps_execution_count(kernel):
    run, kc = kernel
    before = kernel_state(kernel)
    run(list_variables(kc))
    run(list_variables(kc, include_private=True))
    for name in ("df", "matrix", "hostile", "text", "settings"):
        run(preview_variable(kc, name))
    with pytest.raises(GatewayError):
        run(preview_variable(kc, "missing"))
    assert kernel_state(kernel) == before


def test_unknown_variable(kernel):
    run, kc = kernel
    before = kernel_state(kernel)
    with pytest.raises(GatewayError) as caught:
        run(preview_variable(kc, "not_defined_anywhere"))
    assert (caught.value.status, caught.value.code) == (404, "unknown_variable")
    assert "'not_defined_anywhere'" in caught.value.message
    assert kernel_state(kernel) == before


@pytest.mark.parametrize("name", ["1abc", "a.b", "import", "", "x; import os", "df[0]", None, 3])
def test_invalid_names_are_refused_before_reaching_the_kernel(kernel, name):
    run, kc = kernel
    before = kernel_state(kernel)
    with pytest.raises(GatewayError) as caught:
        run(preview_variable(kc, name))
    assert (caught.value.status, caught.value.code) == (400, "invalid_name")
    assert kernel_state(kernel) == before


@pytest.mark.parametrize("value", [0, -1, "10", True, 10**9, 2.5])
def test_bad_bounds_are_refused(kernel, value):
    run, kc = kernel
    with pytest.raises(GatewayError) as caught:
        run(preview_variable(kc, "df", max_chars=value))
    assert (caught.value.status, caught.value.code) == (400, "invalid_max_chars")
    with pytest.raises(GatewayError) as caught:
        run(list_variables(kc, limit=value))
    assert (caught.value.status, caught.value.code) == (400, "invalid_limit")
    with pytest.raises(GatewayError) as caught:
        run(list_variables(kc, include_private="yes"))
    assert caught.value.code == "invalid_include_private"


def test_busy_kernel_gives_a_clear_timeout_and_the_late_reply_is_skipped(kernel):
    run, kc = kernel
    busy = kc.execute("import time; time.sleep(2)", store_history=False)
    with pytest.raises(GatewayError) as caught:
        run(list_variables(kc, timeout=0.3))
    assert (caught.value.status, caught.value.code) == (504, "kernel_busy")
    run(kc._async_recv_reply(busy, timeout=30))
    # The timed-out request's reply is still queued; the next call skips it.
    assert "df" in by_name(run(list_variables(kc)))
