// Explorable figures (code/explorable.py writes them, _ext/explorables.py ships Vega). Each
// block of class "explorable" holds a Vega-Lite specification and a still image of its first
// state. Once the page has loaded, vega-embed (from _static/vega/, loaded on those pages
// only) draws the live chart beside the image, which CSS then hides on screen; the chart's
// parameters are bound to native controls (range inputs, selects, check boxes) that Vega
// writes with their labels. The chart follows the page's light or dark theme: a change of
// theme redraws it and keeps the values the reader chose. Without JavaScript, and in print
// (_static/explorable.css), the block shows the still image and its alt text.
// Jupyter Book adds every CSS and JS file in _static/ to every page.
(() => {
  const live = new Map(); // block -> vega-embed result

  const darkPage = () => document.documentElement.dataset.theme === "dark";

  const boundParams = (spec) => {
    const names = (spec.params || []).filter((p) => p.bind).map((p) => p.name);
    for (const key of ["layer", "hconcat", "vconcat", "concat"]) {
      for (const sub of spec[key] || []) names.push(...boundParams(sub));
    }
    return names;
  };

  const draw = async (block) => {
    const spec = JSON.parse(block.querySelector("script.explorable-spec").textContent);
    const old = live.get(block);
    const values = {};
    if (old) {
      for (const name of boundParams(spec)) values[name] = old.view.signal(name);
      old.finalize();
    }
    let target = block.querySelector(".explorable-live");
    if (!target) {
      target = document.createElement("div");
      target.className = "explorable-live";
      block.appendChild(target);
    }
    const result = await window.vegaEmbed(target, spec, {
      renderer: "svg", // text and marks stay in the page: searchable, testable
      actions: false,
      theme: darkPage() ? "dark" : undefined,
      // vega-themes' dark theme leaves text marks black: give them the theme's label colour
      config: darkPage() ? { text: { color: "#ffffff" } } : {},
    });
    for (const [name, value] of Object.entries(values)) result.view.signal(name, value);
    await result.view.runAsync();
    live.set(block, result);
    block.classList.add("explorable-ready");
  };

  const drawAll = () => {
    const blocks = document.querySelectorAll("div.explorable");
    if (!blocks.length) return;
    if (typeof window.vegaEmbed !== "function") {
      console.error("explorable figures: the Vega bundle (_static/vega/) did not load");
      return;
    }
    blocks.forEach((block) => draw(block).catch((err) => console.error(block.id, err)));
  };

  let theme = null;
  const redrawOnThemeChange = () => {
    if (document.documentElement.dataset.theme === theme) return;
    theme = document.documentElement.dataset.theme;
    drawAll();
  };

  const start = () => {
    redrawOnThemeChange();
    new MutationObserver(redrawOnThemeChange).observe(document.documentElement,
      { attributes: true, attributeFilter: ["data-theme"] });
  };

  const loadBundle = () => {
    const meta = document.querySelector('meta[name="explorable-bundle"]');
    if (!meta) {
      console.error("explorable figures: the page names no Vega bundle");
      return;
    }
    const script = document.createElement("script");
    script.src = meta.content;
    script.onload = start;
    script.onerror = () => console.error("explorable figures: the Vega bundle did not load");
    document.head.appendChild(script);
  };

  window.addEventListener("DOMContentLoaded", () => {
    const blocks = document.querySelectorAll("div.explorable");
    if (!blocks.length) return;
    const near = new IntersectionObserver((entries) => {
      if (!entries.some((entry) => entry.isIntersecting)) return;
      near.disconnect();
      loadBundle();
    }, { rootMargin: "800px 0px" });
    blocks.forEach((block) => near.observe(block));
  });
})();
