// Unit tests for the server's stderr lines in the output channel.
const test = require('node:test');
const assert = require('node:assert/strict');
const { StderrLevels, LogDedupe } = require('../out/log.js');

test('log records keep their level, without the server timestamp', () => {
  const levels = new StderrLevels();
  assert.deepEqual(levels.line('2026-12-05 06:33:01,123 INFO wd_lsp.server: engine ready: tiny'), {
    level: 'info',
    text: 'wd_lsp.server: engine ready: tiny',
    message: 'engine ready: tiny',
  });
  assert.equal(levels.line('2026-12-05 06:33:01,124 DEBUG wd_lsp.acceptance: x').level, 'debug');
  assert.equal(levels.line('2026-12-05 06:33:01,125 WARNING wd_lsp.config: bad key').level, 'warn');
  assert.equal(levels.line('2026-12-05 06:33:01,126 CRITICAL root: gone').level, 'error');
});

test('a traceback keeps the level of its record, or is an error on its own', () => {
  const levels = new StderrLevels();
  assert.equal(levels.line('2026-12-05 06:33:01,123 ERROR wd_lsp.server: inline completion failed').level, 'error');
  assert.deepEqual(levels.line('  File "x.py", line 3, in f'), { level: 'error', text: '  File "x.py", line 3, in f', message: '  File "x.py", line 3, in f' });
  assert.equal(levels.line('2026-12-05 06:33:02,000 INFO wd_lsp.server: connecting').level, 'info');
  assert.equal(levels.line('    more of a message').level, 'info');
  assert.equal(levels.line('Traceback (most recent call last):').level, 'error');
  assert.equal(levels.line('ValueError: boom').level, 'error');
  assert.equal(new StderrLevels().line('something before any record').level, 'warn');
});

test('a message that came both ways is logged once', () => {
  let now = 1000;
  const d = new LogDedupe(5000, () => now);
  assert.equal(d.duplicate('stderr', 'connecting to the engine'), false);
  assert.equal(d.duplicate('lsp', 'connecting to the engine'), true);
  // The same message again later is a new message, from either side first.
  assert.equal(d.duplicate('lsp', 'connecting to the engine'), false);
  assert.equal(d.duplicate('stderr', 'connecting to the engine'), true);
  // Twice from one source is logged twice; a copy after the window is logged too.
  assert.equal(d.duplicate('stderr', 'tick'), false);
  assert.equal(d.duplicate('stderr', 'tick'), false);
  now += 6000;
  assert.equal(d.duplicate('lsp', 'tick'), false);
});
