// Unit tests for the status bar text built from `wdLsp/status` notifications.
const test = require('node:test');
const assert = require('node:assert/strict');
const { statusView, formatLatency } = require('../out/status.js');

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
  assert.equal(formatLatency(999.4), '999 ms');
  assert.equal(formatLatency(1540), '1.5 s');
});
