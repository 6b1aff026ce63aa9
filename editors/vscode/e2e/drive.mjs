// Drives a running code-server in headless Chromium, with VS Code's default editor settings:
//  1. VS Code started without `wd-lsp` on its PATH: exactly one notification says so, and
//     activation is not held up by it (`wd-lsp: Show Log` works while it is on screen); its
//     "Open Settings" button shows the server path setting;
//  2. with wdLsp.server.path set, ghost text appears as you type;
//  3. with the word-suggestion widget open, one Tab inserts the whole ghost text (the selected
//     item and the continuation the server computed for it);
//  4. the manual trigger (Alt+\), the next suggestion (Alt+]), accept-next-word (Ctrl+Right) and
//     accept-next-line (Alt+L) work, and "Show Status" counts the accepts.
// Screenshots of each step go to SCREENSHOT_DIR.
// Usage: node drive.mjs URL FOLDER SCREENSHOT_DIR, with CHROMIUM, PLAYWRIGHT_FROM (the folder
// whose node_modules holds playwright-core) and WD_LSP_PATH in the environment.
import { createRequire } from 'node:module';

const { chromium } = createRequire(`${process.env.PLAYWRIGHT_FROM}/`)('playwright-core');

const [url, folder, shots] = process.argv.slice(2);
const FIRST = 240_000; // the first completion may wait for the engine to load the model
const EDITOR = '.part.editor .monaco-editor';
const GHOST = `${EDITOR} .ghost-text-decoration, ${EDITOR} .ghost-text-decoration-preview`;
const SUGGEST = `${EDITOR} .suggest-widget.visible`;
const TOAST = '.notifications-toasts .notification-toast';

const log = (message) => console.log(`[e2e] ${message}`);
let step = 0;
async function shot(page, name) {
  step += 1;
  await page.screenshot({ path: `${shots}/${String(step).padStart(2, '0')}-${name}.png` });
}

async function command(page, title) {
  await page.keyboard.press('F1');
  const input = page.locator('.quick-input-widget input');
  await input.waitFor({ state: 'visible', timeout: 30_000 });
  await input.fill(`>${title}`);
  await page.locator('.quick-input-widget .monaco-list-row', { hasText: title }).first().waitFor({ timeout: 30_000 });
  await page.keyboard.press('Enter');
}

/** The text of the editor line holding `needle`, without ghost text. */
async function lineText(page, needle) {
  return page.locator(`${EDITOR} .view-line`).evaluateAll(
    (lines, [needle, ghost]) => {
      for (const line of lines) {
        const copy = line.cloneNode(true);
        copy.querySelectorAll(ghost).forEach((g) => g.remove());
        const text = copy.textContent.replace(/\u00a0/g, ' ');
        if (text.includes(needle)) return text;
      }
      return null;
    },
    [needle, '.ghost-text-decoration, .ghost-text-decoration-preview'],
  );
}

/** The ghost text drawn inside the cursor's line (its first line). */
async function inlineGhost(page) {
  return (await page.locator(GHOST).allTextContents()).join('').replace(/\u00a0/g, ' ');
}

async function waitFor(what, check, timeout, poll = 250) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, poll));
  }
}

/** Waits for ghost text; VS Code asks once per edit, so a retyped character asks again. */
async function waitForGhost(page, timeout, retype) {
  const deadline = Date.now() + timeout;
  for (;;) {
    try {
      await page.locator(GHOST).first().waitFor({ state: 'attached', timeout: 15_000 });
      return await inlineGhost(page);
    } catch (err) {
      if (Date.now() > deadline) throw err;
      await retype();
    }
  }
}

async function statusBarText(page) {
  const item = page.locator('.statusbar-item', { hasText: 'wd-lsp' }).first();
  return (await item.count()) ? ((await item.getAttribute('aria-label')) ?? (await item.textContent())) : '';
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking'],
});
let failed = false;
const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
try {
  await page.goto(`${url}/?folder=${encodeURIComponent(folder)}`);
  await page.waitForSelector('.monaco-workbench', { timeout: 120_000 });

  // 1. Not on PATH: one notification, and the extension's commands work meanwhile.
  const notFound = page.locator(TOAST, { hasText: 'could not start the language server' });
  await notFound.first().waitFor({ timeout: 120_000 });
  await page.waitForTimeout(3000); // a second notification would come now
  const toasts = await page.locator(`${TOAST} .notification-list-item-message`).allTextContents();
  log(`notifications: ${JSON.stringify(toasts)}`);
  await shot(page, 'not-on-path');
  const ours = toasts.filter((t) => /wd-lsp|language server|couldn't/i.test(t));
  if (ours.length !== 1) throw new Error(`expected one notification about wd-lsp, got ${ours.length}`);
  if (!/not found on PATH/.test(ours[0])) throw new Error(`the notification does not say why: ${ours[0]}`);

  await command(page, 'wd-lsp: Show Log');
  await page.locator('.part.panel', { hasText: 'was not found on PATH' }).first().waitFor({ timeout: 30_000 });
  if ((await notFound.count()) !== 1) throw new Error('the notification went away before Show Log ran');
  await shot(page, 'show-log-while-notified');
  log('Show Log works while the notification is up');
  const logText = await page.locator('.part.panel .view-lines').first().textContent();
  if (/\[error\].*\bINFO\b/.test(logText ?? '')) throw new Error('server INFO lines logged as errors');

  // The button opens the settings where the path applies: code-server's window is a remote one
  // (the server runs on VS Code's remote side), so the Remote tab.
  await notFound.locator('.monaco-button', { hasText: 'Open Settings' }).first().click();
  const setting = page.locator('.settings-editor .setting-item', { hasText: 'Command that starts the language server' });
  await setting.first().waitFor({ timeout: 30_000 });
  const tab = (await page.locator('.settings-editor .settings-tabs-widget .action-label.checked').first().textContent()) ?? '';
  await shot(page, 'open-settings');
  log(`Open Settings shows the server path setting in the ${JSON.stringify(tab)} tab`);
  if (!/Remote/.test(tab)) throw new Error(`Open Settings opened the ${tab} tab, not Remote`);

  // 2. The path set there, as a user would: the server starts; ghost text as you type.
  await setting.locator('input').first().fill(process.env.WD_LSP_PATH);
  await page.keyboard.press('Tab');
  await waitFor('the server to start', async () => !/error/.test(await statusBarText(page)), 60_000);
  await page.keyboard.press('Escape');
  await shot(page, 'server-starting'); // the status bar: the engine's state and progress

  await page.keyboard.press('Control+P');
  await page.waitForSelector('.quick-input-widget input', { timeout: 30_000 });
  await page.keyboard.type('fib.py');
  await page.waitForTimeout(1000);
  await page.keyboard.press('Enter');
  await page.waitForSelector(`${EDITOR} .view-lines`, { timeout: 60_000 });
  await page.click(`${EDITOR} .view-lines`);
  await page.keyboard.press('Control+G');
  await page.keyboard.type('11'); // the indented empty line in fibonacci
  await page.keyboard.press('Enter');
  await page.keyboard.press('End');
  await page.keyboard.type('return fib', { delay: 60 });
  const first = await waitForGhost(page, FIRST, async () => {
    await page.keyboard.press('Backspace');
    await page.keyboard.type('b', { delay: 60 });
  });
  log(`ghost text while typing: ${JSON.stringify(first)}; suggest widget ${(await page.locator(SUGGEST).count()) ? 'open' : 'closed'}`);
  await shot(page, 'ghost-text');

  // 3. The suggest widget open (Ctrl+Space if VS Code did not open it): one Tab takes all.
  if (!(await page.locator(SUGGEST).count())) await page.keyboard.press('Control+Space');
  await page.locator(SUGGEST).waitFor({ timeout: 30_000 });
  const ghost = await waitForGhost(page, 60_000, async () => {
    await page.keyboard.press('Escape');
    await page.keyboard.press('Backspace');
    await page.keyboard.type('b', { delay: 60 });
    await page.keyboard.press('Control+Space');
    await page.locator(SUGGEST).waitFor({ timeout: 30_000 });
  });
  if (!(await page.locator(SUGGEST).count())) throw new Error('the suggest widget closed');
  const selected = await page.locator(`${SUGGEST} .monaco-list-row.focused`).first().textContent();
  const typed = await lineText(page, 'return fib');
  log(`suggest widget item ${JSON.stringify(selected)}; line ${JSON.stringify(typed)}; ghost ${JSON.stringify(ghost)}`);
  await shot(page, 'suggest-widget-and-ghost-text');
  if (!ghost.trim()) throw new Error('empty ghost text');

  await page.keyboard.press('Tab');
  await page.waitForTimeout(800);
  const afterTab = await lineText(page, 'return fib');
  await shot(page, 'after-one-tab');
  log(`line after one Tab: ${JSON.stringify(afterTab)}`);
  if (!afterTab || !afterTab.startsWith((typed + ghost).trimEnd())) {
    throw new Error(`one Tab did not insert the whole ghost text: ${JSON.stringify(afterTab)}`);
  }
  if (await page.locator(SUGGEST).count()) throw new Error('the suggest widget is still open');
  log('PASS: one Tab took the selected item and the ghost text');

  // 4. A new line: the manual trigger, the next suggestion, accept the next word. No word is
  // being typed after "= ", so the suggest widget stays closed.
  await page.keyboard.press('Escape');
  await page.keyboard.press('End');
  await page.keyboard.press('Enter');
  await page.keyboard.type('x = ', { delay: 60 });
  const automatic = await waitForGhost(page, 60_000, async () => {
    await page.keyboard.press('Backspace');
    await page.keyboard.type(' ', { delay: 60 });
  });
  await page.keyboard.press('Escape');
  await waitFor('the ghost text to go', async () => (await page.locator(GHOST).count()) === 0, 5_000);
  await page.keyboard.press('Alt+Backslash');
  const before = await waitForGhost(page, 30_000, async () => {
    throw new Error('Alt+\\ brought no suggestion');
  });
  log(`manual trigger (Alt+\\): ${JSON.stringify(automatic)} dismissed, then ${JSON.stringify(before)}`);
  await page.keyboard.press('Alt+BracketRight');
  await page.waitForTimeout(1500);
  const next = await inlineGhost(page);
  log(`next suggestion (Alt+]): ${JSON.stringify(before)} -> ${JSON.stringify(next)}`);
  await shot(page, 'next-suggestion');
  if (!next) throw new Error('no ghost text after Alt+]');
  const head = await lineText(page, 'x = ');
  await page.keyboard.press('Control+ArrowRight');
  await page.waitForTimeout(800);
  const afterWord = await lineText(page, 'x = ');
  log(`accept next word (Ctrl+Right): ${JSON.stringify(head)} -> ${JSON.stringify(afterWord)}`);
  if (!afterWord || afterWord.length <= head.length || !(head + next).startsWith(afterWord)) {
    throw new Error('Ctrl+Right did not accept the next word of the suggestion');
  }
  await shot(page, 'accepted-next-word');
  // The rest is one line: accept-next-line takes it all (VS Code then accepts the whole item).
  const rest = await inlineGhost(page);
  await page.keyboard.press('Alt+L');
  await page.waitForTimeout(800);
  const afterLine = await lineText(page, 'x = ');
  log(`accept next line (Alt+L): ${JSON.stringify(rest)} -> ${JSON.stringify(afterLine)}`);
  if (!rest || afterLine?.trimEnd() !== (afterWord + rest).trimEnd()) {
    throw new Error('Alt+L did not accept the rest of the line');
  }
  await page.keyboard.press('Escape');

  await command(page, 'wd-lsp: Show Status');
  const dialog = page.locator('.monaco-dialog-box');
  await dialog.waitFor({ timeout: 30_000 });
  const status = (await dialog.textContent()) ?? '';
  log(`status: ${JSON.stringify(status)}`);
  await shot(page, 'show-status');
  const python = /python: (\d+) shown, (\d+) accepted[^,]*(?:, (\d+) by word)?/.exec(status);
  if (!python) throw new Error('Show Status has no acceptance line for python');
  if (Number(python[2]) < 2 || Number(python[3] ?? 0) < 1) {
    throw new Error(`the accept and the partial accept were not counted: ${python[0]}`);
  }
  await page.keyboard.press('Escape');
  console.log('PASS: the VS Code extension in code-server');
} catch (err) {
  failed = true;
  console.error(`FAIL: ${err.message}`);
  await page.screenshot({ path: `${shots}/failure.png` }).catch(() => {});
  if (process.env.E2E_DUMP) {
    const html = await page.locator(process.env.E2E_DUMP).first().evaluate((e) => e.outerHTML).catch((e) => String(e));
    console.error(html.slice(0, 5000));
  }
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
