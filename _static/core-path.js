// The "Core path" switch, beside the theme switch on every page: on, it hides every deeper
// section (section.deeper, marked by _ext/core_path.py) and its entries in the page's
// contents, on screen and in print. Its state is kept in the browser's local storage, so it
// holds across pages and visits; it works offline and by keyboard (a real <button> with
// aria-pressed), and a live region tells screen readers what changed. A link to a section
// inside a hidden deeper section shows that section. Without JavaScript every section shows.
// Jupyter Book adds every CSS and JS file in _static/ to every page.
(() => {
  const KEY = "attention-computed:core-path";
  const root = document.documentElement;
  const stored = () => { try { return localStorage.getItem(KEY) === "on"; } catch (e) { return false; } };
  const store = (on) => { try { localStorage.setItem(KEY, on ? "on" : "off"); } catch (e) { /* private mode */ } };

  // Before the page is drawn, so that deeper sections never flash on and off.
  root.dataset.corePath = stored() ? "on" : "off";

  const deeperSections = () => [...document.querySelectorAll("section.deeper")]
    .filter((s) => !s.parentElement.closest("section.deeper"));

  // Mark the contents' entries (and their sub-entries) that lead into a deeper section.
  const markEntries = () => {
    // The contents beside the page, and the one the theme prints above it (#jb-print-toc).
    for (const link of document.querySelectorAll(
        ".bd-toc a[href^='#'], .bd-sidebar-secondary a[href^='#'], #jb-print-toc a[href^='#']")) {
      const target = document.getElementById(decodeURIComponent(link.hash.slice(1)));
      if (target && target.closest("section.deeper")) link.closest("li")?.classList.add("deeper-entry");
    }
  };

  // Show the deeper section that holds the target of the address, if the switch hides it.
  const revealTarget = () => {
    document.querySelectorAll("section.deeper-revealed").forEach((s) => s.classList.remove("deeper-revealed"));
    if (!location.hash) return;
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    const section = target && target.closest("section.deeper");
    if (section && root.dataset.corePath === "on") {
      let outer = section;
      while (outer.parentElement.closest("section.deeper")) outer = outer.parentElement.closest("section.deeper");
      outer.classList.add("deeper-revealed");
      target.scrollIntoView();
    }
  };

  const describe = (on) => {
    const count = deeperSections().length;
    if (!on) return "Core path off: every section shows.";
    if (!count) return "Core path on: this page has no deeper section.";
    return `Core path on: ${count} deeper section${count === 1 ? "" : "s"} hidden on this page.`;
  };

  const setUp = () => {
    const theme = document.querySelector(".article-header-buttons .theme-switch-button");
    if (!theme || document.querySelector(".core-path-button")) return;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "btn btn-sm core-path-button";
    button.setAttribute("aria-label", "Core path");  // its words are hidden on a phone
    button.innerHTML = '<span class="fa-solid fa-route" aria-hidden="true"></span>' +
                       '<span class="core-path-label">Core path</span>';
    const live = document.createElement("span");
    live.className = "core-path-status visually-hidden";
    live.setAttribute("role", "status");
    live.setAttribute("aria-live", "polite");
    const show = (on, announce) => {
      root.dataset.corePath = on ? "on" : "off";
      button.setAttribute("aria-pressed", String(on));
      button.title = on ? "Core path on: deeper sections hidden (press to show them)"
                        : "Core path off: press to hide the deeper sections";
      if (announce) live.textContent = describe(on);
      revealTarget();
    };
    button.addEventListener("click", () => {
      const on = root.dataset.corePath !== "on";
      store(on);
      show(on, true);
    });
    theme.parentElement.insertBefore(button, theme);
    button.after(live);
    markEntries();
    show(root.dataset.corePath === "on", false);
    // Another tab or window changed the switch: follow it.
    window.addEventListener("storage", (event) => { if (event.key === KEY) show(stored(), true); });
    window.addEventListener("hashchange", revealTarget);
  };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUp);
  else setUp();
})();
