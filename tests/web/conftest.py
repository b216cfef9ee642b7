"""The headless Chromium (Debian's, driven by Playwright) that each UI test module shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ui_testlib import CHROMIUM, CHROMIUM_ARGS


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
