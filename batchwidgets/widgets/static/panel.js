// batchwidgets panels: one ES module for every panel, rendered by anywidget in JupyterLab,
// Notebook 7, Classic Notebook 6, VS Code, Colab and marimo. The kernel owns all state: this
// module draws the panel's `layout_spec` once, redraws each part from `parts` (and `images`),
// and sends one message per user action ({event: "set" | "click", name, value}); the kernel
// sets its control as code would and sends the state back, so a refused value snaps back.

const el_ = (tag, className, text) => {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
};

function labelled(root, state) {
  // a control with its description in front, as ipywidgets draws one
  const label = el_("span", "bw-description");
  root.appendChild(label);
  return (s) => {
    label.textContent = s.description || "";
    label.style.display = s.description ? "" : "none";
  };
}

const KINDS = {
  button(send) {
    const node = el_("button", "bw-button");
    node.type = "button";
    node.addEventListener("click", () => send("click"));
    return [node, (s) => {
      node.textContent = s.description;
      node.disabled = !!s.disabled;
      node.title = s.tooltip || "";
    }];
  },
  label() {
    const node = el_("div", "bw-label");
    return [node, (s) => { node.textContent = s.value || ""; node.title = s.value || ""; }];
  },
  html() {
    const node = el_("div", "bw-html");
    let shown = null;
    return [node, (s) => {
      if (s.value !== shown) { node.innerHTML = s.value || ""; shown = s.value; }
    }];
  },
  text() {
    const node = el_("div", "bw-text");
    const describe = labelled(node);
    const input = el_("input");
    input.type = "text";
    input.readOnly = true;
    input.addEventListener("focus", () => input.select());
    node.appendChild(input);
    return [node, (s) => { describe(s); input.value = s.value || ""; input.title = s.tooltip || ""; }];
  },
  checkbox(send) {
    const node = el_("label", "bw-checkbox");
    const input = el_("input");
    input.type = "checkbox";
    const text = el_("span");
    node.append(input, text);
    input.addEventListener("change", () => send("set", input.checked));
    return [node, (s) => {
      input.checked = !!s.value;
      input.disabled = !!s.disabled;
      text.textContent = s.description || "";
      node.title = s.tooltip || "";
    }];
  },
  dropdown(send) {
    const node = el_("div", "bw-dropdown");
    const describe = labelled(node);
    const select = el_("select");
    node.appendChild(select);
    let labels = null;
    select.addEventListener("change", () => send("set", select.selectedIndex));
    return [node, (s) => {
      describe(s);
      const next = JSON.stringify(s.labels || []);
      if (next !== labels) {
        select.replaceChildren(...(s.labels || []).map((l) => el_("option", null, l)));
        labels = next;
      }
      if (select.selectedIndex !== s.index) select.selectedIndex = s.index;
      select.disabled = !!s.disabled;
      select.title = s.tooltip || "";
    }];
  },
  slider(send) {
    const node = el_("div", "bw-slider");
    const describe = labelled(node);
    const input = el_("input");
    input.type = "range";
    const readout = el_("span", "bw-readout");
    node.append(input, readout);
    input.addEventListener("input", () => { readout.textContent = Number(input.value).toFixed(2); });
    input.addEventListener("change", () => send("set", Number(input.value)));
    return [node, (s) => {
      describe(s);
      input.min = s.min; input.max = s.max; input.step = s.step;
      input.value = s.value;
      input.disabled = !!s.disabled;
      readout.textContent = Number(s.value).toFixed(2);
    }];
  },
  int(send) {
    const node = el_("div", "bw-int");
    const describe = labelled(node);
    const input = el_("input");
    input.type = "number";
    node.appendChild(input);
    input.addEventListener("change", () => send("set", parseInt(input.value, 10)));
    return [node, (s) => {
      describe(s);
      input.min = s.min; input.max = s.max;
      if (document.activeElement !== input) input.value = s.value;
      input.disabled = !!s.disabled;
    }];
  },
  progress() {
    const node = el_("div", "bw-progress");
    const describe = labelled(node);
    const bar = el_("progress");
    node.appendChild(bar);
    return [node, (s) => {
      describe(s);
      bar.max = Math.max(s.max - s.min, 1);
      bar.value = s.value - s.min;
      node.dataset.style = s.bar_style || "";
    }];
  },
  image() {
    const node = el_("img", "bw-image");
    node.alt = "batchwidgets live plot";
    return [node, (s, src) => {
      // no src, no image: never a broken-image icon while a plot is not drawn yet
      if (src) { if (node.getAttribute("src") !== src) node.src = src; node.style.display = ""; }
      else { node.removeAttribute("src"); node.style.display = "none"; }
    }];
  },
};

function render({ model, el }) {
  const css = model.get("css_name");
  const root = el_("div", `batchwidgets-panel batchwidgets-${css}`);
  const views = [];
  const part = (name) => {
    const state = (model.get("parts") || {})[name] || { kind: "label" };
    const make = KINDS[state.kind] || KINDS.label;
    const send = (event, value) => model.send({ event, name, value });
    const [node, update] = make(send);
    node.classList.add(`batchwidgets-${css}-${name.replaceAll("_", "-")}`);
    views.push([name, update]);
    return node;
  };
  const section = (spec) => {
    if (spec.columns) {
      const node = el_("div", "bw-columns");
      for (const column of spec.columns) node.appendChild(section({ class: "column", ...column }));
      return node;
    }
    if (spec.tabs) {
      const node = el_("div", "bw-tabs");
      const bar = el_("div", "bw-tab-bar");
      node.appendChild(bar);
      const bodies = spec.tabs.map((tab, i) => {
        const button = el_("button", "bw-tab", tab.title);
        button.type = "button";
        const body = section({ parts: tab.parts, class: "column" });
        body.classList.add("bw-tab-body");
        button.addEventListener("click", () => select(i));
        bar.appendChild(button);
        node.appendChild(body);
        return [button, body];
      });
      const select = (chosen) => bodies.forEach(([button, body], i) => {
        button.classList.toggle("bw-selected", i === chosen);
        body.style.display = i === chosen ? "" : "none";
      });
      select(0);
      return node;
    }
    const node = el_("div", `bw-${spec.class || "row"}`);
    for (const name of spec.parts || []) node.appendChild(part(name));
    return node;
  };
  for (const spec of model.get("layout_spec") || []) root.appendChild(section(spec));
  const update = () => {
    const parts = model.get("parts") || {};
    const images = model.get("images") || {};
    for (const [name, draw] of views) if (parts[name]) draw(parts[name], images[name] || "");
  };
  model.on("change:parts", update);
  model.on("change:images", update);
  update();
  el.appendChild(root);
  return () => {
    model.off("change:parts", update);
    model.off("change:images", update);
  };
}

export default { render };
