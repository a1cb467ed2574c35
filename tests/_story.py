"""One story per report (issue 41): what tests/results/test_report_consistency.py checks on every
report, its static HTML, its panel and every report the tutorials make.

``problems(report, extra_texts)`` returns what does not agree, one line each:
1. rules: every learning-rate factor ("from B = b to B' = b': ×F by <rule>"), every trade-off
   ("B = b: S× the fewest steps and E× the fewest examples"), every comparison of two estimates,
   the ratio of the critical batch to B_simple and the probe's recommendation rule are recomputed
   here from the numbers they name, by the rule they name;
2. words: "predicted", "measured", "traced", "fake", "real steps", "the whole data set" and the
   counts beside them, against the attempts and fields they speak of;
3. numbers: every other number printed (summary, advice, text form, rows, HTML tables, panels) is
   a field or property of the report at its printed precision (units read: KiB.., ms, s, %).
   The summary, the advice and the text form draw on the report's own fields and those of the
   single reports it holds; its rows, tables and panels on every nested field too.
Numbers inside a field that is itself text (``method``, ``reason`` a field, ``warnings``, a
what-if's ``cost``) come from that field, and are taken out before the numbers are read.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
from collections.abc import Iterable
from typing import Any

from batchwidgets.results._text import TextForm

# Numbers of the prose: years cited, the equation cited, "2× each" at the critical batch, the
# S_min·(1 + B/B_simple) formulas' 1, and the percentages of a what-if's cost lines.
PROSE = {0.0, 1.0, 2.0, 2017.0, 2018.0, 2025.0, 2.7, 2.8}

NUMBER = re.compile(
    r"(?<![\w.\-/])(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?(?:e(?P<exp>[-+]\d+))?"
    r"(?!(?!x\b)\w)(?P<unit>%| (?:(?:B|KiB|MiB|GiB|TiB)(?:/s)?|ms|s)(?![\w/]))?")
UNITS = {"B": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40, "ms": 1e-3,
         "s": 1.0, "%": 0.01}
NUM = r"(\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?)"


def value(text: str) -> float:
    return float(text.replace(",", ""))


def tolerance(text: str) -> float:
    """Half a unit of the last digit printed (``1.2e+03``: 50)."""
    mantissa, _, exponent = text.replace(",", "").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals) * 10.0 ** (int(exponent) if exponent else 0)


def agrees(printed: str, exact: float, slack: float = 0.0) -> bool:
    """``printed`` is ``exact`` at its printed precision (plus ``slack``, for an ``exact`` that
    is itself recomputed from printed inputs)."""
    return abs(value(printed) - exact) <= tolerance(printed) * (1 + 1e-9) + slack + 1e-12


# ---- what a report holds --------------------------------------------------------------------

def _properties(obj: Any) -> Iterable[str]:
    for cls in type(obj).__mro__:
        for name, member in vars(cls).items():
            if isinstance(member, property) and not name.startswith("_"):
                yield name


def _children(obj: Any) -> Iterable[Any]:
    """A report's fields and properties (a property that raises is skipped)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield getattr(obj, field.name)
        for name in _properties(obj):
            try:
                yield getattr(obj, name)
            except Exception:  # a property that does not apply to this report
                continue


def numbers(obj: Any, depth: int, deep: bool) -> set[float]:
    """Every number ``obj`` holds, ``depth`` levels down: the single reports it holds, and with
    ``deep`` the items of its tuples and dicts of reports too."""
    found: set[float] = set()
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return found
    if isinstance(obj, (int, float)):
        return {abs(float(obj))} if math.isfinite(obj) else found
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (tuple, list)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj) and depth > 0:
        items = list(_children(obj))
        depth -= 1
    else:
        return found
    if deep and isinstance(obj, (tuple, list)) and any(dataclasses.is_dataclass(i) for i in obj):
        found |= set(map(float, range(1, len(obj) + 1)))  # a table's "#" column
    for item in items:
        nested = dataclasses.is_dataclass(item) or isinstance(item, (tuple, list, dict))
        if nested and isinstance(obj, (tuple, list, dict)) and not deep and any(
                dataclasses.is_dataclass(i) for i in items):
            continue  # the summary does not read the items of a list of reports
        found |= numbers(item, depth, deep)
    return found


def text_fields(obj: Any, depth: int = 4) -> list[str]:
    """Every field of ``obj`` (and its nested reports) that is itself text."""
    found: list[str] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and depth:
        for field in dataclasses.fields(obj):
            found += text_fields(getattr(obj, field.name), depth - 1)
        if not isinstance(obj, TextForm) and "__str__" in type(obj).__dict__:
            found.append(str(obj))  # a field's own words (report.remembered: when, where)
    elif isinstance(obj, str):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            found += text_fields(item, depth)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            found += [*text_fields(key, depth), *text_fields(item, depth)]
    return found


# ---- the texts ------------------------------------------------------------------------------

def plain(page: str) -> str:
    """An HTML page's text: images out, cells apart."""
    page = re.sub(r"<img[^>]*>", " ", page)
    page = re.sub(r"</t[dh]>", " | ", page)
    page = re.sub(r"<[^>]+>", " ", page)
    return html.unescape(page)


def texts(report: Any) -> dict[str, str]:
    """Where the report speaks: its summary, advice and text form (drawing on its own fields),
    its rows and its static HTML (drawing on everything it holds)."""
    said = {"summary": report.summary(), "text": str(report)}
    advice = getattr(report, "advice", "")
    if isinstance(advice, str) and advice:
        said["advice"] = advice
    if hasattr(report, "rows"):
        said["rows"] = " | ".join(f"{label}: {value}" for label, value in report.rows())
    said["html"] = plain(report._repr_html_())
    return said


SHALLOW = ("summary", "text", "advice")


# ---- 1. rules -------------------------------------------------------------------------------

def noise_scale(b_noise: float, batch: float, new: float) -> float:
    """McCandlish et al. 2018, eq. 2.7: eps_opt(B) ~ 1/(1 + B_noise/B), from B to B'."""
    return (1 + b_noise / batch) / (1 + b_noise / new)


RULES = {
    "the noise-scale rule": noise_scale,
    "linear scaling": lambda _noise, batch, new: new / batch,
}
FACTOR = re.compile(rf"from B = {NUM} to B' = {NUM}:")
CLAIM = re.compile(rf"×{NUM} by (the noise-scale rule|linear scaling)"
                   rf"(?: at B_(?:simple|noise) = {NUM})?")
TRADE_OFF = re.compile(rf"B = {NUM}: {NUM}× the fewest steps and {NUM}× the fewest examples")
COMPARED = re.compile(rf"B_simple {NUM}(?: ± {NUM})? [^:]*? and {NUM}(?: ± {NUM})? [^:]*?: "
                      rf"(agree within their errors|differ by more than their errors) "
                      rf"\(difference {NUM} ± {NUM}, {NUM} standard errors\)")


ABOVE = re.compile(rf"B = {NUM} \w+ \({NUM} micro-batches\) is {NUM}× B_simple ≈ {NUM}")


def check_rules(report: Any, text: str, problems: list[str]) -> str:
    """Recompute every rule the text names; returns the text with what was checked taken out."""
    headers = list(FACTOR.finditer(text))
    for i, found in enumerate(headers):  # each claim follows its header, before the next one
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        batch, new = value(found[1]), value(found[2])
        claims = list(CLAIM.finditer(text, found.end(), end))
        if not claims:
            problems.append(f"{found[0]!r} names no rule with its factor")
        for claim in claims:
            factor, rule, b_noise = claim[1], claim[2], claim[3]
            if rule == "the noise-scale rule" and b_noise is None:
                problems.append(f"the noise-scale rule without its B_noise: {claim[0]!r}")
                continue
            noise = value(b_noise) if b_noise else 0.0
            spread = tolerance(b_noise) if b_noise else 0.0
            low, high = sorted(RULES[rule](n, batch, new) for n in (noise - spread,
                                                                    noise + spread))
            if not (agrees(factor, low, high - low) or agrees(factor, high, high - low)):
                problems.append(f"{rule} from B = {found[1]} to {found[2]} gives "
                                f"{RULES[rule](noise, batch, new):.4g}, not ×{factor}")
    if CLAIM.search(text) and not headers:
        problems.append(f"a factor without the batches it goes from and to: "
                        f"{CLAIM.search(text)[0]!r}")
    text = CLAIM.sub(" ", FACTOR.sub(" ", text))
    b_simple = getattr(report, "b_simple", None)
    for found in TRADE_OFF.finditer(text):
        if not isinstance(b_simple, float) or not math.isfinite(b_simple):
            problems.append(f"a trade-off without B_simple: {found[0]!r}")
            continue
        batch = value(found[1])
        if not agrees(found[2], 1 + b_simple / batch):
            problems.append(f"S/S_min at B = {found[1]} is {1 + b_simple / batch:.4g}, not "
                            f"{found[2]}")
        if not agrees(found[3], 1 + batch / b_simple):
            problems.append(f"E/E_min at B = {found[1]} is {1 + batch / b_simple:.4g}, not "
                            f"{found[3]}")
    text = TRADE_OFF.sub(" ", text)
    for found in COMPARED.finditer(text):
        a, ea, b, eb = (value(found[i]) if found[i] else 0.0 for i in (1, 2, 3, 4))
        spread = math.hypot(ea, eb)
        if not agrees(found[6], abs(a - b), tolerance(found[1]) + tolerance(found[3])):
            problems.append(f"the difference of {found[1]} and {found[3]} is not {found[6]}")
        if not agrees(found[7], spread, tolerance(found[2] or "0") + tolerance(found[4] or "0")):
            problems.append(f"the combined error of {found[2]} and {found[4]} is not {found[7]}")
        within = abs(a - b) <= 2 * spread
        if within != (found[5] == "agree within their errors"):
            problems.append(f"{found[1]} and {found[3]} ± {found[7]}: not '{found[5]}'")
    text = COMPARED.sub(" ", text)
    for found in ABOVE.finditer(text):  # accumulation_advice: B over B_simple
        b_simple_printed = found[4]
        ratio = value(found[1]) / value(b_simple_printed)
        spread = ratio * tolerance(b_simple_printed) / value(b_simple_printed)
        if not agrees(found[3], ratio, spread):
            problems.append(f"B = {found[1]} over B_simple ≈ {found[4]} is {ratio:.3g}, not "
                            f"{found[3]}×")
    text = ABOVE.sub(" ", text)
    return _probe_rules(report, _critical_ratio(report, text, problems), problems)


def _critical_ratio(report: Any, text: str, problems: list[str]) -> str:
    critical = report if hasattr(report, "agreement") else getattr(report, "critical", None)
    ratio = getattr(critical, "ratio", None)
    for found in re.finditer(rf"\(ratio {NUM}(?: ± {NUM})?: ([a-z ]+)\)", text):
        if ratio is None or not agrees(found[1], ratio):
            problems.append(f"ratio {found[1]} is not critical / B_simple = {ratio}")
        elif found[2] and not agrees(found[2], critical.ratio_error):
            problems.append(f"ratio's error {found[2]} is not {critical.ratio_error}")
        elif found[3] != critical.agreement:
            problems.append(f"ratio {found[1]}: '{found[3]}', not '{critical.agreement}'")
    return re.sub(rf"\(ratio {NUM}(?: ± {NUM})?: ([a-z ]+)\)", " ", text)


def _probe_rules(report: Any, text: str, problems: list[str]) -> str:
    found = re.search(rf"headroom {NUM} x max_batch_size, rounded down to a multiple of {NUM}",
                      text)
    if found:
        headroom, multiple = value(found[1]), int(value(found[2]))
        report = getattr(report, "probe", None) or report  # a BatchSplitReport's, its probe's
        size = report.max_batch_size
        expected = max(min(multiple, size), int(headroom * size) // multiple * multiple)
        if report.recommended_batch_size != expected:
            problems.append(f"the rule {found[0]!r} gives {expected}, not "
                            f"{report.recommended_batch_size}")
        text = text.replace(found[0], " ")
    if "the fastest size measured" in text:
        ran = [a for a in report.attempts if a.fits and a.samples_per_s and not a.fake]
        fastest = max(ran, key=lambda a: a.samples_per_s).batch_size if ran else None
        if report.recommended_batch_size != fastest:
            problems.append(f"'the fastest size measured' is {fastest}, not "
                            f"{report.recommended_batch_size}")
    return text


# ---- 2. words -------------------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def check_words(report: Any, said: dict[str, str], problems: list[str]) -> None:
    kinds = {cls.__name__ for cls in type(report).__mro__}
    if "BatchSizeReport" in kinds:
        _probe_words(report, said, problems)
    elif "NoiseReport" in kinds:
        names = {"whole": "the whole data set", "finite": "(?<!in)finite-population rule",
                 "infinite": "infinite-population rule"}
        for rule, words in names.items():
            if bool(re.search(words, said["summary"])) != (rule == report.population_rule):
                problems.append(f"summary says {words!r} but the rule is "
                                f"{report.population_rule!r}")
        found = re.search(r"from (\d+) examples", said["summary"])
        if found and int(found[1]) != report.n_examples:
            problems.append(f"'{found[0]}' but n_examples={report.n_examples}")
    elif "CriticalBatchReport" in kinds:
        found = re.search(r"measured from (\d+) branches, (\d+) seed", said["summary"])
        if found and (int(found[1]), int(found[2])) != (len(report.ladder), report.seeds_fitted):
            problems.append(f"'{found[0]}' but {len(report.ladder)} branches, "
                            f"{report.seeds_fitted} seeds fitted")
    elif "NoiseTrackerReport" in kinds:
        for found in re.finditer(r"(?:after|over) (\d+) updates", said["summary"]):
            if int(found[1]) != report.n_updates:
                problems.append(f"'{found[0]}' but n_updates={report.n_updates}")
    elif "LoaderReport" in kinds:
        found = re.search(r"\((\d+) of (\d+) settings tried", said["summary"])
        if found and (int(found[1]), int(found[2])) != (len(report.trials), report.grid_size):
            problems.append(f"'{found[0]}' but {len(report.trials)} of {report.grid_size}")


def _probe_words(report: Any, said: dict[str, str], problems: list[str]) -> None:
    fake = [a.batch_size for a in report.attempts if a.fake]
    real = [a.batch_size for a in report.attempts if not a.fake]
    predicted = "predicted, not run" in said["summary"]
    if predicted != (report.target is not None):
        problems.append(f"summary {'says' if predicted else 'does not say'} 'predicted, not "
                        f"run' with target={report.target!r}")
    if report.target is None:
        found = re.search(r"(\d+) tries(?: after (\d+) on fake tensors)?, (\d+) OOM",
                          said["summary"])
        counts = (len(real), len(fake), report.n_ooms)
        if not found or (int(found[1]), int(found[2] or 0), int(found[3])) != counts:
            problems.append(f"summary's tries (real, fake, OOM) are not {counts}")
        top = [a for a in report.attempts if not a.fake and a.fits
               and a.batch_size == report.max_batch_size]
        if report.max_batch_size and not top:
            problems.append(f"max_batch_size={report.max_batch_size} was not measured by a "
                            f"real step that fit")
    traced = dict(report.rows())["traced"]
    found_real = re.search(r"real steps at sizes ([\d, ]+)", traced)
    found_fake = re.search(r"fake tensors at sizes ([\d, ]+)", traced)
    if (_sizes(found_real[1]) if found_real else []) != (real if report.trace == "real" else []):
        problems.append(f"traced row {traced!r}: real steps are at sizes {real}")
    if (_sizes(found_fake[1]) if found_fake else []) != fake:
        problems.append(f"traced row {traced!r}: fake traces are at sizes {fake}")
    if report.trace == "fake" and real:
        problems.append("a plan traced on fake tensors has real attempts")
    if report.target is not None and any(row.measured for row in report.what_if):
        problems.append("a target plan has a measured what-if")
    answer = said.get("panel:answer", "")
    if "measured" in answer and report.target is not None:
        problems.append("the panel says measured for a plan")
    if "predicted" in answer and report.target is None:
        problems.append("the panel says predicted for a measured answer")


# ---- 3. numbers -----------------------------------------------------------------------------

def check_numbers(name: str, text: str, pool: set[float], problems: list[str]) -> None:
    for found in NUMBER.finditer(text):
        printed = found["int"] + (found["frac"] or "") + (
            f"e{found['exp']}" if found["exp"] else "")
        scale = UNITS.get((found["unit"] or "").strip().removesuffix("/s"), 1.0)
        x, tol = value(printed) * scale, tolerance(printed) * scale
        if x in PROSE and scale == 1.0:
            continue
        if not any(abs(x - v) <= tol * (1 + 1e-9) + 1e-12 for v in pool):
            start = max(found.start() - 40, 0)
            problems.append(f"{name}: {found[0].strip()!r} is no field of the report "
                            f"(…{text[start:found.end() + 20]}…)")


def panel_texts(panel: Any) -> dict[str, str]:
    """What a panel shows in words: each of its labels and HTML parts, and its static copy."""
    said = {f"panel:{name}": plain(control.value) for name, control in vars(panel).items()
            if type(control).__name__ in ("HTML", "Label", "Text")
            and isinstance(control.value, str)}
    bundle = panel._repr_mimebundle_()
    said["panel:static"] = plain(bundle["text/html"]) + " | " + bundle["text/plain"]
    return said


def problems(report: Any, extra: dict[str, str] | None = None) -> list[str]:
    """Everything in ``report``'s texts (and ``extra``, e.g. its panel's) that disagrees."""
    said = {**texts(report), **(extra or {})}
    found: list[str] = []
    check_words(report, said, found)
    shallow = numbers(report, depth=2, deep=False)
    deep = numbers(report, depth=4, deep=True)
    fields = sorted({f for f in text_fields(report) if re.search(r"\d", f)}, key=len,
                    reverse=True)
    for name, text in said.items():
        # a field that is text has its own numbers: a cell that is one, or a long one anywhere
        text = " | ".join(" " if cell.strip() in fields else cell for cell in text.split(" | "))
        for field in fields:
            if len(field) > 12:
                text = text.replace(field, " ")
        text = check_rules(report, text, found)
        pool = shallow if name in SHALLOW else deep
        probe = getattr(report, "probe", None) or report  # a BatchSplitReport tells its probe's
        if name == "text" and getattr(probe, "what_if", ()):  # its what-if line reads the rows
            pool = pool | numbers(probe.what_if, depth=2, deep=True)
        check_numbers(name, text, pool, found)
    return found


def reports_in(namespace: dict) -> list:
    """Every report a notebook's namespace holds: the values, their panels' and lists'."""
    found, seen = [], set()

    def visit(value, depth=0):
        if id(value) in seen or depth > 2:
            return
        seen.add(id(value))
        if isinstance(value, TextForm):
            found.append(value)
        elif isinstance(value, (list, tuple)) and len(value) < 100:
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict) and len(value) < 100:
            for item in value.values():
                visit(item, depth + 1)
        elif type(value).__name__.endswith("Panel"):
            visit(getattr(value, "report", None), depth + 1)

    for name, value in list(namespace.items()):
        if not name.startswith("_") or name == "_":
            visit(value)
    return found


_CHECKED: dict[int, tuple[Any, list[str]]] = {}  # id -> (the report, kept alive; its problems)


def told_in(namespace: dict) -> dict[str, list[str]]:
    """What each report in ``namespace`` (a notebook's globals) gets wrong, by its name there.
    Reports are frozen: each one is checked once, however many cells later it is still held."""
    names = {id(value): name for name, value in namespace.items()}
    told = {}
    for report in reports_in(namespace):
        kept = _CHECKED.get(id(report))
        if kept is None or kept[0] is not report:
            kept = _CHECKED[id(report)] = (report, problems(report))
        found = kept[1]
        if found:
            told[f"{names.get(id(report), 'a report')}: {type(report).__name__}"] = found
    return told
