"""report.html as a person sees it: Debian's Chromium, headless, renders a real run's page at a phone's width and
at two desktop widths, and a script in the page measures what a reader would notice: no sideways scrolling, each
verdict's cells and its reason (the why-line) on the screen and unclipped, figures on the screen (on a phone scaled
to its width, on a desktop legible).

Slow (a run and three browser starts); it needs Debian's ``chromium`` (``apt-get install chromium``) and is
skipped, saying so, where the machine has none.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.run.runner import run_audit

from conftest import small_audit

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")]
WIDTHS = (390, 1280, 1920)
LEGIBLE = 0.6  # a figure drawn at 100 dpi keeps its 10-point text at 8 px or more
PHONE = 700  # the page's phone layout: tables as cards, figures at the screen's width

#: Injected first: errors the page raises or logs, kept for the probe.
CATCH = """<script>window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const _error = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); _error(...a); };
</script>"""

#: Injected last: what a reader notices, written into the framing page's DOM for --dump-dom to carry out.
PROBE = """<script>window.addEventListener('load', () => {
  const settings = new Set(%s);
  const broken = [];
  for (const td of document.querySelectorAll('td')) {
    const text = td.firstChild;
    if (!text || text.nodeType !== 3 || !settings.has(text.textContent.trim())) continue;
    const range = document.createRange(); range.selectNodeContents(text);
    const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
    if (lines > 1) broken.push(text.textContent.trim());
  }
  const figures = [...document.querySelectorAll('img')].map(
    i => [i.alt, i.clientWidth, i.naturalWidth, Math.round(i.getBoundingClientRect().right)]);
  const offscreen = e => { const r = e.getBoundingClientRect();
    return r.width === 0 || r.height === 0 || r.left < 0 || r.right > window.innerWidth + 0.5
           || e.scrollWidth > e.clientWidth + 1; };
  const cells = [...document.querySelectorAll('table.verdicts td')];
  const why = cells.filter(td => td.closest('tr').classList.contains('why'));
  parent.document.body.setAttribute('data-probe', JSON.stringify({
    overflow: document.documentElement.scrollWidth - window.innerWidth, broken, figures, inner: window.innerWidth,
    why: why.length, hidden: cells.filter(offscreen).map(td => td.textContent.trim().slice(0, 60)),
    errors: window.__errors}));
});</script>"""


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A real run's report.html (the undefended reference and two noise settings) and its setting names."""
    folder = tmp_path_factory.mktemp("browser")
    path = folder / "audit.yaml"
    import yaml

    audit = small_audit(defenses=[{"name": "none"}, {"name": "gaussian", "sweep": {"sigma": [0.01, 1.0]}}],
                        attacks=[{"name": "inverting_gradients", "params": {"iterations": 20}}],
                        utility={"train_steps": 20})
    path.write_text(yaml.safe_dump(audit, sort_keys=False))
    summary = run_audit(load_audit(path), folder / "out", progress=False)
    return folder / "out" / "report.html", [w.setting for w in summary.worst_case]


def _probe(report, settings: list[str], width: int, tmp_path) -> dict:
    """The probe's findings on the page shown ``width`` px wide: in a frame of that width, since headless Chromium
    lays a window narrower than 500 px out at 500 until it takes a screenshot."""
    text = report.read_text()
    probed = text.replace("<head>", "<head>" + CATCH, 1).replace("</body>", PROBE % json.dumps(settings) + "</body>", 1)
    framing = tmp_path / f"probe-{width}.html"
    framing.write_text(f'<!doctype html><html><body style="margin:0"><iframe style="border:0;width:{width}px;'
                       f'height:900px" srcdoc="{html.escape(probed)}"></iframe></body></html>')
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--disable-background-networking", f"--window-size={max(width, 800)},1000",
                           "--virtual-time-budget=5000", "--dump-dom", framing.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert found, f"the probe did not run at {width} px: {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.parametrize("width", WIDTHS)
def test_the_report_reads_at_a_phones_width_and_at_desktop_widths(page, width, tmp_path):
    report, settings = page
    seen = _probe(report, settings, width, tmp_path)
    assert seen["errors"] == []
    assert seen["inner"] == width, f"the window is {seen['inner']} px wide, not {width}"
    assert seen["overflow"] <= 0, f"the page scrolls sideways by {seen['overflow']} px at {width} px"
    assert seen["broken"] == [], f"setting names broken mid-word at {width} px: {seen['broken']}"
    assert seen["why"] == len(settings), f"{seen['why']} why-lines for {len(settings)} settings"
    assert seen["hidden"] == [], f"verdict cells off the screen or clipped at {width} px: {seen['hidden']}"
    assert seen["figures"], "no figure on the page"
    for alt, shown, natural, right in seen["figures"]:
        assert right <= width, f"{alt}: its right edge at {right} px, past the screen's {width} px"
        if width > PHONE:  # on a phone a wide figure is scaled to the screen (a reader zooms in)
            assert shown >= LEGIBLE * natural, f"{alt}: drawn at {shown} of {natural} px at {width} px"
