"""A panel is one anywidget widget: its controls are Python facades over one synced trait.

Every front end that runs anywidget (JupyterLab, Notebook 7, Classic Notebook 6, VS Code, Colab,
marimo) renders a panel from one ES module shipped in this package (``static/panel.js``); no
ipywidgets child is ever sent, so a front end whose ipywidgets differs from the kernel's cannot
fail on a "model not registered" for one of them.

A control here (``Button``, ``Dropdown``, ``FloatSlider``...) is a ``traitlets.HasTraits`` with
the ipywidgets names and behaviour the panels and their users rely on (``.value``, ``.observe``,
``.disabled``, ``.options``, ``.click()``, ``.on_click``), not a widget: it has no comm. The
panel mirrors each control's state into its ``parts`` trait (images into ``images``), and the
front end sends one custom message per user action (``{"event": "set", "name": ..., "value":
...}`` or ``{"event": "click", "name": ...}``), which sets the control as code would. So a click
and ``panel.num_workers.value = 2`` run the same observers, on the kernel's main thread.

Usage:
    >>> panel = Panel(css_name="demo", layout=[{"parts": ["go", "status"]}],
    ...               go=Button(description="Go"), status=Label(value="ready"))
    >>> panel.controls["go"].on_click(lambda b: setattr(panel.controls["status"], "value", "went"))
    >>> panel.controls["go"].click(); panel.parts["status"]["value"]
    'went'
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anywidget
import traitlets

STATIC = Path(__file__).resolve().parent / "static"


class Control(traitlets.HasTraits):
    """What every control has: a ``description`` (its label), ``disabled`` and a ``tooltip``."""

    kind: ClassVar[str] = ""
    description = traitlets.Unicode("")
    disabled = traitlets.Bool(False)
    tooltip = traitlets.Unicode("")

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("layout", "style", "indent")}
        super().__init__(**kwargs)

    def state(self) -> dict[str, Any]:
        """What the front end draws (JSON)."""
        return {"kind": self.kind, "description": self.description, "disabled": self.disabled,
                "tooltip": self.tooltip}

    def receive(self, value: Any) -> None:
        """A user's change from the front end (ignored while disabled, as a browser does)."""
        if not self.disabled:
            self.value = value


class Button(Control):
    """``on_click(callback)`` runs ``callback(button)`` at each ``click()`` (and each click in
    the front end, unless disabled)."""

    kind = "button"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._clicks: list[Callable[[Button], Any]] = []

    def on_click(self, callback: Callable[[Button], Any], remove: bool = False) -> None:
        if remove:
            self._clicks.remove(callback)
        else:
            self._clicks.append(callback)

    def click(self) -> None:
        for callback in list(self._clicks):
            callback(self)

    def receive(self, value: Any) -> None:
        if not self.disabled:
            self.click()


class Label(Control):
    """Plain text."""

    kind = "label"
    value = traitlets.Unicode("")

    def state(self) -> dict[str, Any]:
        return {**super().state(), "value": self.value}


class HTML(Label):
    """HTML made by this package (every user-provided string in it is escaped)."""

    kind = "html"


class Text(Label):
    """A one-line text box (the code to copy)."""

    kind = "text"


class Checkbox(Control):
    kind = "checkbox"
    value = traitlets.Bool(False)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "value": self.value}

    def receive(self, value: Any) -> None:
        super().receive(bool(value))


def _pairs(options: Sequence[Any]) -> list[tuple[str, Any]]:
    return [option if isinstance(option, tuple) else (str(option), option) for option in options]


class Dropdown(Control):
    """A choice among ``options``: values, or ``(label, value)`` pairs. ``value`` must be one of
    them; new ``options`` without the value select the first. ``index`` is the position."""

    kind = "dropdown"
    options = traitlets.Any(())
    value = traitlets.Any(None)
    index = traitlets.Int(0)

    def __init__(self, options: Sequence[Any] = (), value: Any = None, **kwargs: Any) -> None:
        pairs = _pairs(options)
        if value is None and pairs and None not in [v for _, v in pairs]:
            value = pairs[0][1]
        super().__init__(options=tuple(options), value=value, **kwargs)

    @property
    def values(self) -> list[Any]:
        return [value for _, value in _pairs(self.options)]

    @property
    def label(self) -> str | None:
        """The label of the value shown."""
        pairs = _pairs(self.options)
        return pairs[self.index][0] if 0 <= self.index < len(pairs) else None

    @traitlets.validate("value")
    def _valid_value(self, proposal: dict) -> Any:
        value = proposal["value"]
        if value not in self.values and not (value is None and not self.values):
            raise traitlets.TraitError(f"{self.description or 'value'}={value!r} is not one of "
                                       f"the options {self.values!r}")
        return value

    @traitlets.observe("value")
    def _index_follows(self, change: dict) -> None:
        if change["new"] in self.values:
            self.index = self.values.index(change["new"])

    @traitlets.observe("index")
    def _value_follows(self, change: dict) -> None:
        values = self.values
        if 0 <= change["new"] < len(values) and values[change["new"]] != self.value:
            self.value = values[change["new"]]

    @traitlets.observe("options")
    def _keep_value(self, change: dict) -> None:
        values = self.values
        if self.value in values:
            self.index = values.index(self.value)
        elif values:
            self.value = values[0]

    def state(self) -> dict[str, Any]:
        return {**super().state(), "labels": [label for label, _ in _pairs(self.options)],
                "index": self.index}

    def receive(self, value: Any) -> None:
        """The front end sends the chosen position (values need not be JSON)."""
        if not self.disabled and isinstance(value, int) and 0 <= value < len(self.values):
            self.index = value


class _Bounded(Control):
    """A number kept within ``[min, max]``, as ipywidgets' bounded widgets keep theirs."""

    @traitlets.validate("value")
    def _clamp(self, proposal: dict) -> Any:
        return min(max(proposal["value"], self.min), self.max)

    @traitlets.observe("min", "max")
    def _reclamp(self, _change: dict) -> None:
        self.value = min(max(self.value, self.min), self.max)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "value": self.value, "min": self.min, "max": self.max}


class FloatSlider(_Bounded):
    kind = "slider"
    value = traitlets.Float(0.0)
    min = traitlets.Float(0.0)
    max = traitlets.Float(1.0)
    step = traitlets.Float(0.1)
    readout_format = traitlets.Unicode(".2f")
    continuous_update = traitlets.Bool(False)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "step": self.step}

    def receive(self, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            super().receive(float(value))


class BoundedIntText(_Bounded):
    kind = "int"
    value = traitlets.Int(0)
    min = traitlets.Int(0)
    max = traitlets.Int(100)

    def receive(self, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            super().receive(int(value))


class IntProgress(Control):
    kind = "progress"
    value = traitlets.Int(0)
    min = traitlets.Int(0)
    max = traitlets.Int(100)
    bar_style = traitlets.Unicode("")

    def state(self) -> dict[str, Any]:
        return {**super().state(), "value": self.value, "min": self.min, "max": self.max,
                "bar_style": self.bar_style}

    def receive(self, value: Any) -> None:  # not a user's control
        pass


class Image(Control):
    """A PNG (``value``: its bytes); the front end shows nothing, not a broken image, while
    there are none."""

    kind = "image"
    value = traitlets.Bytes(b"")
    format = traitlets.Unicode("png")

    def data_url(self) -> str:
        if not self.value:
            return ""
        return (f"data:image/{self.format};base64,"
                f"{base64.b64encode(bytes(self.value)).decode('ascii')}")

    def receive(self, value: Any) -> None:
        pass


class Panel(anywidget.AnyWidget):
    """One anywidget widget drawing its ``controls`` as ``layout`` says.

    ``layout`` is a list of sections, each ``{"parts": [names], "class": "row" | "column"}``
    (a row of parts, or a column), ``{"columns": [section, ...]}`` (sections side by side) or
    ``{"tabs": [{"title": str, "parts": [names]}, ...]}`` (one part group shown at a time).
    The front end gives the panel the class ``batchwidgets-<css_name>`` and each part
    ``batchwidgets-<css_name>-<name>`` (``_`` written ``-``), for stylesheets and browser tests.
    """

    # Class traits, so that AnyWidget's __init__ adds none to the instance: add_traits would make
    # every panel an instance of a new subclass (type(panel) is not LoaderPanel, no pickling).
    _esm = traitlets.Unicode((STATIC / "panel.js").read_text(encoding="utf-8")).tag(sync=True)
    _css = traitlets.Unicode((STATIC / "panel.css").read_text(encoding="utf-8")).tag(sync=True)
    _anywidget_id = traitlets.Unicode(f"{__name__}.Panel").tag(sync=True)
    css_name = traitlets.Unicode("").tag(sync=True)
    layout_spec = traitlets.List().tag(sync=True)
    parts = traitlets.Dict().tag(sync=True)
    images = traitlets.Dict().tag(sync=True)

    def __init__(self, *, css_name: str, layout: list[dict[str, Any]],
                 **controls: Control) -> None:
        super().__init__(css_name=css_name, layout_spec=layout)
        self._mirror = threading.RLock()  # controls change from any thread (probe, refresher)
        self.controls: dict[str, Control] = {}
        self.add_controls(**controls)
        self.on_msg(self._on_front_end)

    def add_traits(self, **traits: Any) -> None:
        """Only the traits this class lacks (none, from AnyWidget's __init__)."""
        new = {name: trait for name, trait in traits.items() if not self.has_trait(name)}
        if new:
            super().add_traits(**new)

    def add_controls(self, **controls: Control) -> None:
        for name, control in controls.items():
            self.controls[name] = control
            control.observe(lambda _change, name=name: self._mirror_one(name), names=traitlets.All)
            self._mirror_one(name)

    def _mirror_one(self, name: str) -> None:
        control = self.controls[name]
        with self._mirror:
            if isinstance(control, Image):
                self.images = {**self.images, name: control.data_url()}
                self.parts = {**self.parts, name: control.state()}
            else:
                self.parts = {**self.parts, name: control.state()}

    def _on_front_end(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A user's action: set the control as code would (its observers run here)."""
        if not isinstance(content, dict) or content.get("name") not in self.controls:
            return
        control = self.controls[content["name"]]
        if content.get("event") == "click":
            control.receive(None)
        elif content.get("event") == "set":
            with contextlib.suppress(traitlets.TraitError):
                control.receive(content.get("value"))
            self._mirror_one(content["name"])  # a refused or clamped value: the front end follows
