// Unit tests for the status bar text, its hover and the "Show Status" summary.
const test = require('node:test');
const assert = require('node:assert/strict');
const { statusView, formatLatency, StatusTracker, statusSummary, acceptanceLines } = require('../out/status.js');

test('ready shows the last latency', () => {
  const v = statusView({ state: 'ready', message: 'wd-coder-tiny', lastLatencyMs: 41.7 });
  assert.equal(v.text, '$(sparkle) wd-lsp 42 ms');
  assert.match(v.tooltip, /wd-coder-tiny/);
  assert.equal(v.error, false);
});

test('other states show the state name', () => {
  assert.equal(statusView({ state: 'loading', message: '', lastLatencyMs: null }).text, '$(loading~spin) wd-lsp loading');
  assert.equal(statusView({ state: 'disabled', message: '' }).text, '$(circle-slash) wd-lsp disabled');
  const err = statusView({ state: 'error', message: 'engine died' });
  assert.equal(err.error, true);
  assert.match(err.tooltip, /engine died/);
});

test('unknown states are shown as errors', () => {
  assert.equal(statusView({ state: 'weird' }).error, true);
});

test('latency formatting', () => {
  assert.equal(formatLatency(null), null);
  assert.equal(formatLatency(-3), null);
  assert.equal(formatLatency(999.4), '999 ms');
  assert.equal(formatLatency(1540), '1.5 s');
});

test('the hover names the last completion once, in one unit', () => {
  const v = statusView({ state: 'ready', message: 'last completion 4634 ms', lastLatencyMs: 4633.7 });
  assert.equal((v.tooltip.match(/last completion/gi) ?? []).length, 1);
  assert.match(v.tooltip, /Last completion: 4\.6 s/);
  assert.doesNotMatch(v.tooltip, /4634/);
});

test('an answer from memory (right after an accept) keeps the last engine latency', () => {
  const t = new StatusTracker();
  assert.equal(t.update({ state: 'ready', lastLatencyMs: 231.2 }).text, '$(sparkle) wd-lsp 231 ms');
  const after = t.update({ state: 'ready', message: 'last completion 0 ms', lastLatencyMs: 0.3 });
  assert.equal(after.text, '$(sparkle) wd-lsp 231 ms');
  assert.doesNotMatch(after.tooltip, /0 ms/);
  assert.equal(t.update({ state: 'loading', message: 'loading the model', lastLatencyMs: null }).text, '$(loading~spin) wd-lsp loading');
  assert.equal(t.update({ state: 'ready', lastLatencyMs: 88 }).text, '$(sparkle) wd-lsp 88 ms');
  // Before any engine answer there is no latency to show.
  assert.equal(new StatusTracker().update({ state: 'ready', lastLatencyMs: 1 }).text, '$(sparkle) wd-lsp');
});

test('acceptance lines per language, with the acceptance rate', () => {
  assert.deepEqual(
    acceptanceLines({
      rust: { shown: 3, accepted: 0, partialWord: 0, partialLine: 0 },
      python: { shown: 12, accepted: 5, partialWord: 2, partialLine: 1 },
      lua: { shown: 0, accepted: 0 },
    }),
    [
      'lua: 0 shown, 0 accepted',
      'python: 12 shown, 5 accepted (42%), 2 by word, 1 by line',
      'rust: 3 shown, 0 accepted (0%)',
    ],
  );
  assert.deepEqual(acceptanceLines(undefined), []);
  assert.deepEqual(acceptanceLines('nonsense'), []);
});

test('Show Status: a short summary, latencies rounded, no raw fields', () => {
  const s = statusSummary({
    version: '0.1.0',
    enabled: true,
    engine: 'ready',
    engineError: null,
    model: 'wd-coder-tiny',
    lastLatencyMs: 133.67674800019813,
    p50LatencyMs: 1520.2,
    requests: 40,
    acceptance: { python: { shown: 4, accepted: 1, partialWord: 1, partialLine: 0 } },
    engineStats: { device: 'cpu', kv: { used: 3 } },
  });
  assert.equal(s.title, 'wd-lsp: ready');
  const text = s.lines.join('\n');
  assert.match(text, /Model: wd-coder-tiny/);
  assert.match(text, /Latency: last 134 ms, median 1\.5 s/);
  assert.match(text, /python: 4 shown, 1 accepted \(25%\), 1 by word/);
  assert.match(text, /Server: wd-lsp 0\.1\.0/);
  assert.doesNotMatch(text, /133\.67|engineStats|\{|lastLatencyMs/);
});

test('Show Status: off, errors, nothing shown yet, a memory answer', () => {
  const s = statusSummary({ engine: 'error', enabled: false, engineError: 'no model', lastLatencyMs: 0.2 });
  const text = s.lines.join('\n');
  assert.equal(s.title, 'wd-lsp: error');
  assert.match(text, /Completions: off/);
  assert.match(text, /Engine error: no model/);
  assert.match(text, /none shown yet/);
  assert.doesNotMatch(text, /Latency/);
  assert.equal(statusSummary(null).title, 'wd-lsp: unknown');
  const loading = statusSummary({ engine: 'starting', engineMessage: 'loading the model (3 s)' });
  assert.match(loading.lines.join('\n'), /Engine: loading the model \(3 s\)/);
  assert.doesNotMatch(statusSummary({ engine: 'ready', engineMessage: 'ready' }).lines.join('\n'), /Engine:/);
});
