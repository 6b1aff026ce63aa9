// Unit tests for the settings -> server configuration mapping (compiled by `npm test`).
const test = require('node:test');
const assert = require('node:assert/strict');
const { serverSettings, launchSettings, configurationPayload, needsRestart } = require('../out/config.js');

const from = (values) => (key) => values[key];

test('defaults match the server defaults', () => {
  assert.deepEqual(serverSettings(from({})), {
    enabled: true,
    debounceMs: 60,
    maxTokens: 64,
    multiline: 'auto',
    enabledLanguages: ['*'],
    temperature: 0,
    beams: 2,
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
});

test('bad values fall back to defaults', () => {
  const s = serverSettings(from({ multiline: 'sometimes', enabledLanguages: [], debounceMs: 'x' }));
  assert.equal(s.multiline, 'auto');
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
