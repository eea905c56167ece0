"""paper_tables.json against the paper's LaTeX source: every table there, every number of every
table as printed and in the printed order, every protocol setting on the line it cites, and the
misprints it marks checked against the tables' own definitions."""
import json
import math
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES_JSON = os.path.join(ROOT, "paper_tables.json")
NUM = re.compile(r"\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def paper():
    with open(TABLES_JSON) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def tex(paper):
    path = os.path.normpath(os.path.join(ROOT, paper["about"]["source"]))
    if not os.path.isfile(path):
        msg = f"the paper's source is missing at {path}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def tex_tables(tex):
    """{label: tabular body} of every table environment of the source."""
    out = {}
    for block in re.findall(r"\\begin\{table\}.*?\\end\{table\}", tex, re.S):
        labels = re.findall(r"\\label\{([^}]*)\}", block)
        assert len(labels) == 1, block[:200]
        bodies = re.findall(r"\\begin\{tabularx?\}(?:\{[^}]*\}){1,2}(.*?)\\end\{tabularx?\}", block, re.S)
        assert len(bodies) == 1, labels
        out[labels[0]] = bodies[0]
    return out


def _cell(text):
    """A cell as printed: commands that only format are dropped."""
    text = re.sub(r"\\cite\{[^}]*\}", "", text)
    text = re.sub(r"\\multicolumn\{[^}]*\}\{[^}]*\}", "", text)
    while "\\textbf{" in text:
        text = re.sub(r"\\textbf\{([^{}]*)\}", r"\1", text)
    return text.replace("~", " ").replace("$", "").strip(" {}\n")


def printed_rows(body):
    """The rows of a tabular that print numbers: the cells after the row's first, numbers as
    strings and '-' / 'N/A' as None; cells of words are left out."""
    rows = []
    for line in body.split("\\\\"):
        line = re.sub(r"\\(top|mid|bottom)rule", "", line)
        cells = [_cell(c) for c in line.split("&")][1:]
        nums = [None if c in ("-", "N/A") else c for c in cells
                if c in ("-", "N/A") or re.fullmatch(NUM, c)]
        if any(n is not None for n in nums):
            rows.append(nums)
    return rows


def _printed(v):
    return None if v is None else repr(v)


def json_rows(table):
    """The same rows from the JSON: numeric column heads, then each row's k (where it has one)
    and values."""
    rows = []
    if all(isinstance(c, (int, float)) for c in table["columns"]):
        rows.append([_printed(c) for c in table["columns"]])
    for r in table["rows"]:
        assert len(r["values"]) == len(table["columns"]), r
        rows.append([_printed(v) for v in ([r["k"]] if "k" in r else []) + r["values"]])
    return rows


def test_every_table_of_the_paper_is_transcribed_once(paper, tex):
    assert list(paper["tables"]) == list(tex_tables(tex))   # the same labels, in the paper's order


def test_every_number_as_printed_in_its_table(paper, tex):
    bodies = tex_tables(tex)
    for label, table in paper["tables"].items():
        assert json_rows(table) == printed_rows(bodies[label]), label


def test_tables_have_what_a_reader_needs(paper):
    for label, t in paper["tables"].items():
        assert t["caption"] and t["section"] and t["columns"] and t["rows"], label
        assert isinstance(t["misprints"], list), label
        for m in t["misprints"]:
            assert {"printed", "right", "why"} <= set(m), (label, m)
            if "column" in m:   # a cell: the printed value is the one kept in values
                assert t["rows"][m["row"]]["values"][m["column"]] == m["printed"], (label, m)


def _numbers(value):
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _settings(node, path=()):
    """Every setting ({"value", "line", ...}) under the protocols, with its path."""
    if isinstance(node, dict) and "line" in node:
        yield path, node
    elif isinstance(node, dict):
        for key, sub in node.items():
            yield from _settings(sub, path + (key,))


def _line_numbers(line):
    return {float(n) for n in NUM.findall(re.sub(r"(\d),(\d{3})", r"\1\2", line))}


def test_every_protocol_setting_is_on_the_line_it_cites(paper, tex):
    lines = tex.split("\n")
    settings = list(_settings(paper["protocols"]))
    assert len(settings) > 60
    for path, s in settings:
        line = lines[s["line"] - 1]
        assert s["where"] and "value" in s, path
        if "printed" in s:
            assert s["printed"] in line, (path, s["printed"])
        else:
            nums = _numbers(s["value"])
            assert nums, (path, "a setting in words needs the words it stands for: 'printed'")
            missing = [n for n in nums if n not in _line_numbers(line)]
            assert not missing, (path, missing, line[:120])


def test_the_data_facts_of_the_remote_sensing_tables_are_on_their_lines(paper, tex):
    lines = tex.split("\n")
    for label, t in paper["tables"].items():
        if "data" in t:
            facts = {k: v for k, v in t["data"].items() if k != "line"}
            have = _line_numbers(lines[t["data"]["line"] - 1])
            assert all(n in have for n in _numbers(facts)), label


def _right(table, row, col):
    for m in table["misprints"]:
        if m.get("row") == row and m.get("column") == col:
            return m["right"], True
    return table["rows"][row]["values"][col], False


def test_uneven_target_stds_follow_the_appendix_formula_but_where_marked(paper):
    """n_i = N i^x / sum i^x, i = 0 .. k-1, N = 50,000; the sample std of the unrounded targets."""
    t = paper["tables"]["dis-com"]
    for r, row in enumerate(t["rows"]):
        if row["row"] != "std":
            continue
        k = row["k_clusters"]
        for c, x in enumerate(t["x"]):
            w = [float(i) ** x for i in range(k)]    # 0 ** 0 = 1: x = 0 is even
            n = [50_000 * v / sum(w) for v in w]
            mean = sum(n) / k
            std = math.sqrt(sum((v - mean) ** 2 for v in n) / (k - 1))
            right, marked = _right(t, r, c)
            assert round(std, 1) == pytest.approx(right, abs=1e-9), (row["dataset"], x, std, marked)


def test_mean_cluster_sizes_are_n_over_k_but_where_marked(paper):
    for label in ("diff-k-10", "diff-k-100"):
        t = paper["tables"][label]
        for c, k in enumerate(t["columns"]):
            right, marked = _right(t, 0, c)
            assert abs(right - 50_000 / k) <= 0.05 + 1e-9, (label, k, right, marked)
        assert sum(1 for m in t["misprints"] if "column" in m) == 1


def test_toy_clusterings_pairs_but_where_marked(paper):
    """Four images: the sizes sum to 4, IND = sum of n_i (n_i - 1) / 2, DIS = 6 - IND."""
    for label in ("tbcl4", "tbcl3", "tbcl2"):
        t = paper["tables"][label]
        for r, row in enumerate(t["rows"]):
            sizes = [_right(t, r, c)[0] for c in range(len(row["values"]) - 2)]
            ind, dis = row["values"][-2:]
            assert sum(sizes) == 4, (label, row)
            assert ind == sum(n * (n - 1) // 2 for n in sizes) and dis == 6 - ind, (label, row)


def test_division_1_is_the_siri_whu_table(paper):
    whu, five = paper["tables"]["whu"], paper["tables"]["5whu"]
    one = [r for r in five["rows"] if r["division"] == 1]
    assert [r["values"] for r in one] == [r["values"][:2] for r in whu["rows"]]
