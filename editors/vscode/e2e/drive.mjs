// Drives a running code-server in headless Chromium: opens fib.py, types in it, waits for the
// wd-lsp ghost text in the editor's DOM, keeps a screenshot, accepts it with Tab and checks the
// line grew. Usage: node drive.mjs URL FOLDER SCREENSHOT_DIR, with CHROMIUM and PLAYWRIGHT_FROM
// (the folder whose node_modules holds playwright-core) in the environment.
import { createRequire } from 'node:module';

const { chromium } = createRequire(`${process.env.PLAYWRIGHT_FROM}/`)('playwright-core');

const [url, folder, shots] = process.argv.slice(2);
const LONG = 240_000; // the first completion starts the engine and loads the model

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
  // Quick Open the file.
  await page.waitForTimeout(3000);
  await page.keyboard.press('Control+P');
  await page.waitForSelector('.quick-input-widget input', { timeout: 30_000 });
  await page.keyboard.type('fib.py');
  await page.waitForTimeout(1000);
  await page.keyboard.press('Enter');
  await page.waitForSelector('.monaco-editor .view-lines', { timeout: 60_000 });
  await page.click('.monaco-editor .view-lines');
  // Go to line 11 (the indented empty line in fibonacci) and type there.
  await page.keyboard.press('Control+G');
  await page.keyboard.type('11');
  await page.keyboard.press('Enter');
  await page.keyboard.press('End');
  for (const ch of 'return fib') {
    await page.keyboard.type(ch, { delay: 40 });
  }
  const ghost = page.locator('.monaco-editor .ghost-text-decoration, .monaco-editor .ghost-text');
  // VS Code asks once per edit: a keystroke made while the engine was still loading gets no
  // suggestion, so retype the last character now and then, as a user would keep typing.
  const deadline = Date.now() + LONG;
  for (;;) {
    try {
      await ghost.first().waitFor({ state: 'attached', timeout: 15_000 });
      break;
    } catch (err) {
      if (Date.now() > deadline) throw err;
      await page.keyboard.press('Backspace');
      await page.keyboard.type('b', { delay: 40 });
    }
  }
  // Inline ghost text comes as several decoration spans on one line.
  const ghostText = (await ghost.allTextContents()).join('');
  console.log(`ghost text: ${JSON.stringify(ghostText)}`);
  await page.screenshot({ path: `${shots}/vscode-ghost-text.png` });
  if (!ghostText.trim()) throw new Error('empty ghost text');

  await page.keyboard.press('Tab');
  await page.waitForTimeout(1000);
  // A new suggestion may follow the accepted one: dismiss it so the line holds only real text.
  await page.keyboard.press('Escape');
  await page.waitForTimeout(500);
  const line = await page.locator('.monaco-editor .view-line').evaluateAll((els) =>
    els.map((e) => e.textContent.replace(/\u00a0/g, ' ')).find((t) => t.includes('return fib')),
  );
  console.log(`line after Tab: ${JSON.stringify(line)}`);
  await page.screenshot({ path: `${shots}/vscode-accepted.png` });
  // The first line of the suggestion is drawn inline (.ghost-text-decoration), the rest below it.
  const inline = await page.locator('.monaco-editor .ghost-text-decoration').allTextContents().catch(() => []);
  const first = (inline.length ? inline.join('') : ghostText).replace(/\u00a0/g, ' ');
  if (!line || !line.includes('return fib' + first.trimEnd())) {
    throw new Error(`the accepted text is not in the line: ${JSON.stringify(line)}`);
  }
  console.log('PASS: ghost text shown and accepted in VS Code');
} catch (err) {
  failed = true;
  console.error(`FAIL: ${err.message}`);
  await page.screenshot({ path: `${shots}/vscode-failure.png` }).catch(() => {});
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
