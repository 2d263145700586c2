"""report.html as a person sees it: Debian's Chromium, headless, renders a real run's page at a phone's width and
at two desktop widths, and a script in the page measures what a reader would notice.

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

#: Injected first: errors the page raises or logs, kept for the probe.
CATCH = """<script>window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const _error = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); _error(...a); };
</script>"""

#: Injected last: what a reader notices, written into the DOM for --dump-dom to carry out.
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
  const figures = [...document.querySelectorAll('img')].map(i => [i.alt, i.clientWidth, i.naturalWidth]);
  document.body.setAttribute('data-probe', JSON.stringify({
    overflow: document.documentElement.scrollWidth - window.innerWidth, broken, figures,
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
    text = report.read_text()
    probed = tmp_path / f"probe-{width}.html"
    probed.write_text(text.replace("<head>", "<head>" + CATCH, 1)
                      .replace("</body>", PROBE % json.dumps(settings) + "</body>", 1))
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={width},900", "--virtual-time-budget=5000", "--dump-dom",
                           probed.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert found, f"the probe did not run at {width} px: {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.parametrize("width", WIDTHS)
def test_the_report_reads_at_a_phones_width_and_at_desktop_widths(page, width, tmp_path):
    report, settings = page
    seen = _probe(report, settings, width, tmp_path)
    assert seen["errors"] == []
    assert seen["overflow"] <= 0, f"the page scrolls sideways by {seen['overflow']} px at {width} px"
    assert seen["broken"] == [], f"setting names broken mid-word at {width} px: {seen['broken']}"
    assert seen["figures"], "no figure on the page"
    for alt, shown, natural in seen["figures"]:
        assert shown >= LEGIBLE * natural, f"{alt}: drawn at {shown} of {natural} px at {width} px"
