// Keyboard readers scroll a region sideways by giving it focus, so whatever scrolls needs a Tab
// stop (WCAG 2.1.1; axe-core's scrollable-region-focusable). pydata-sphinx-theme sets them on
// code blocks and outputs when the page loads, but not for formulas (the site takes formulas
// out of the Tab order: see _ext/offline_mathjax.py), nor in solutions opened later, which
// have no width at load. This sets them for wide display formulas once MathJax has typeset
// them, after a resize, and inside a dropdown when it opens (a key press on a toggle button
// arrives as a click). Jupyter Book adds every CSS and JS file in _static/ to every page.
(() => {
  const SCROLLERS = "pre, .cell_output > .output, mjx-container";

  const scrolls = (el) => {
    const style = getComputedStyle(el), scroller = /auto|scroll/;
    return (scroller.test(style.overflowX) && el.scrollWidth > el.clientWidth) ||
           (scroller.test(style.overflowY) && el.scrollHeight > el.clientHeight);
  };

  const setTabStops = (root) => {
    root.querySelectorAll(SCROLLERS).forEach((el) => {
      if (scrolls(el)) {
        el.tabIndex = 0;
      } else if (el.tagName !== "MJX-CONTAINER") {
        el.tabIndex = -1; // as the theme does; formulas keep MathJax's own setting
      }
    });
  };

  window.addEventListener("load", () => {
    const startup = window.MathJax && window.MathJax.startup;
    if (startup && startup.promise) startup.promise.then(() => setTabStops(document));
  });

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => setTabStops(document), 300);
  });

  document.addEventListener("click", (event) => {
    const toggle = event.target.closest(".toggle-button, .admonition-title, summary");
    const box = toggle && toggle.closest(".toggle, details");
    if (box) requestAnimationFrame(() => setTabStops(box));
  });
})();
