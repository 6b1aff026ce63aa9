// Unit tests for the settings -> server configuration mapping (compiled by `npm test`).
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { serverSettings, launchSettings, configurationPayload, needsRestart, findExecutable } = require('../out/config.js');

const from = (values) => (key) => values[key];

test('defaults match the server defaults', () => {
  assert.deepEqual(serverSettings(from({})), {
    enabled: true,
    debounce: 'adaptive',
    debounceMs: 60,
    maxTokens: 64,
    multiline: 'auto',
    enabledLanguages: ['*'],
    temperature: 0,
    beams: 2,
    suggestions: 3,
  });
});

test('settings map to server keys, empty strings mean unset', () => {
  const s = serverSettings(
    from({
      enabled: false,
      model: ' /models/coder ',
      'engine.socket': '',
      'engine.tcp': '10.0.0.2:7000',
      'engine.token': 'secret',
      debounceMs: 12.6,
      maxTokens: 0,
      multiline: 'single',
      enabledLanguages: ['python', 'lua'],
      temperature: 0.2,
      beams: 12,
      debounce: 'fixed',
      suggestions: 0,
    }),
  );
  assert.equal(s.enabled, false);
  assert.equal(s.model, '/models/coder');
  assert.deepEqual(s.engine, { tcp: '10.0.0.2:7000', token: 'secret' });
  assert.equal(s.debounceMs, 13);
  assert.equal(s.maxTokens, 1);
  assert.equal(s.multiline, 'single');
  assert.deepEqual(s.enabledLanguages, ['python', 'lua']);
  assert.equal(s.temperature, 0.2);
  assert.equal(s.beams, 8);
  assert.equal(s.debounce, 'fixed');
  assert.equal(s.suggestions, 1);
});

test('bad values fall back to defaults', () => {
  const s = serverSettings(from({ multiline: 'sometimes', enabledLanguages: [], debounceMs: 'x', debounce: 'slow', suggestions: 99 }));
  assert.equal(s.multiline, 'auto');
  assert.equal(s.debounce, 'adaptive');
  assert.equal(s.suggestions, 8);
  assert.deepEqual(s.enabledLanguages, ['*']);
  assert.equal(s.debounceMs, 60);
});

test('didChangeConfiguration payload is {settings: {wdLsp: ...}}', () => {
  const s = serverSettings(from({}));
  assert.deepEqual(configurationPayload(s), { settings: { wdLsp: s } });
});

test('launch settings default to wd-lsp on PATH', () => {
  assert.deepEqual(launchSettings(from({})), { command: 'wd-lsp', args: [], env: {} });
  assert.deepEqual(
    launchSettings(from({ 'server.path': '/opt/bin/wd-lsp', 'server.args': ['--log', 'x'], 'server.env': { WD_LSP_MODEL: '/m' } })),
    { command: '/opt/bin/wd-lsp', args: ['--log', 'x'], env: { WD_LSP_MODEL: '/m' } },
  );
  assert.equal(launchSettings(from({ 'server.path': '~/venv/bin/wd-lsp' })).command, path.join(os.homedir(), 'venv/bin/wd-lsp'));
});

test('the server command is looked up on PATH like spawning it will', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'wd-lsp-path-'));
  const bin = path.join(dir, 'bin');
  fs.mkdirSync(bin);
  const exe = path.join(bin, `wd-lsp-${process.pid}`);
  fs.writeFileSync(exe, '#!/bin/sh\n', { mode: 0o755 });
  const plain = path.join(bin, 'not-executable');
  fs.writeFileSync(plain, '', { mode: 0o644 });
  try {
    const name = path.basename(exe);
    assert.equal(findExecutable(name, { PATH: `/nonexistent${path.delimiter}${bin}` }, 'linux'), exe);
    assert.equal(findExecutable(name, { PATH: '/nonexistent' }, 'linux'), null);
    assert.equal(findExecutable(name, {}, 'linux'), null);
    assert.equal(findExecutable(exe, { PATH: '' }, 'linux'), exe);
    assert.equal(findExecutable(path.join(bin, 'missing'), { PATH: bin }, 'linux'), null);
    assert.equal(findExecutable('not-executable', { PATH: bin }, 'linux'), null);
    assert.equal(findExecutable(bin, { PATH: '' }, 'linux'), null, 'a folder is not a command');
    // A relative path resolves against a working folder not known here: left to the spawn.
    assert.equal(findExecutable('./venv/bin/wd-lsp', { PATH: '' }, 'linux'), './venv/bin/wd-lsp');
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('unset keys are left out, and removing one asks for a restart', () => {
  const withModel = serverSettings(from({ model: '/m', 'engine.socket': '/s' }));
  const without = serverSettings(from({ 'engine.socket': '/s' }));
  assert.ok(!('model' in without) && !('engine' in serverSettings(from({}))));
  assert.equal(needsRestart(withModel, without), true);
  assert.equal(needsRestart(without, withModel), false);
  assert.equal(needsRestart(withModel, serverSettings(from({ model: '/m' }))), true);
  assert.equal(needsRestart(withModel, serverSettings(from({ model: '/m', 'engine.socket': '/s', maxTokens: 9 }))), false);
});

test('an OpenAI-compatible backend is forwarded only when chosen', () => {
  const s = serverSettings(
    from({ backend: 'openai', 'openai.baseUrl': 'http://gpu:8000/v1', 'openai.apiKey': ' k ', 'openai.fim': 'suffix' }),
  );
  assert.equal(s.backend, 'openai');
  assert.deepEqual(s.openai, { baseUrl: 'http://gpu:8000/v1', apiKey: 'k', fim: 'suffix' });
  const plain = serverSettings(from({ backend: 'engine', 'openai.fim': 'nonsense' }));
  assert.equal(plain.backend, undefined);
  assert.equal(plain.openai, undefined);
  assert.equal(needsRestart(s, plain), true);
});
