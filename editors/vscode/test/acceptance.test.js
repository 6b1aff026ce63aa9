// Unit tests for finding the inline item on screen, for the acceptance statistics.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ItemLog, itemId } = require('../out/acceptance.js');

test('the item ID comes from the wdLsp.accepted command', () => {
  assert.equal(itemId({ title: 't', command: 'wdLsp.accepted', arguments: [{ id: 'a-1', kind: 'full' }] }), 'a-1');
  assert.equal(itemId({ command: 'other', arguments: [{ id: 'a-1' }] }), undefined);
  assert.equal(itemId({ command: 'wdLsp.accepted', arguments: [] }), undefined);
  assert.equal(itemId({ command: 'wdLsp.accepted', arguments: [{ id: 7 }] }), undefined);
  assert.equal(itemId(undefined), undefined);
});

// A one-document model: lines of text, and the cursor.
function doc(lines, cursor) {
  return (line, character) => {
    if (line > cursor.line || (line === cursor.line && character > cursor.character)) return null;
    const parts = [];
    for (let l = line; l <= cursor.line; l++) {
      const from = l === line ? character : 0;
      const to = l === cursor.line ? cursor.character : lines[l].length;
      parts.push(lines[l].slice(from, to));
    }
    return parts.join('\n');
  };
}

test('a partial accept is matched to the item it took from', () => {
  const log = new ItemLog();
  const head = '    x = ';
  log.record('file:///a.py', [
    { id: 'i1', text: `${head}math.atan2(n, n)`, line: 3, character: 0 },
    { id: 'i2', text: `${head}fib(n - 1)`, line: 3, character: 0 },
  ]);
  const lines = ['', '', '', `${head}fib`];
  assert.equal(log.partlyAccepted('file:///a.py', doc(lines, { line: 3, character: lines[3].length })).id, 'i2');
  lines[3] = `${head}math`;
  assert.equal(log.partlyAccepted('file:///a.py', doc(lines, { line: 3, character: lines[3].length })).id, 'i1');
  lines[3] = `${head}zzz`;
  assert.equal(log.partlyAccepted('file:///a.py', doc(lines, { line: 3, character: lines[3].length })), undefined);
  assert.equal(log.partlyAccepted('file:///other.py', doc(lines, { line: 3, character: 4 })), undefined);
});

test('an accept that took a whole item is not a partial one', () => {
  const log = new ItemLog();
  log.record('u', [
    { id: 'short', text: 'x = fib(n)', line: 0, character: 0 },
    { id: 'long', text: 'x = fib(n) + 1', line: 0, character: 0 },
  ]);
  // VS Code ran the short item's command: it took that item whole.
  assert.equal(log.partlyAccepted('u', () => 'x = fib(n)', new Set(['short'])), undefined);
  // No command ran: the longer item was on screen and the accept took part of it.
  assert.equal(log.partlyAccepted('u', () => 'x = fib(n)').id, 'long');
  assert.equal(log.partlyAccepted('u', () => 'x = fib(n) +').id, 'long');
  // The only item the text equals, with no longer one: a whole accept whose command comes later.
  log.record('u', [{ id: 'only', text: 'y = 1', line: 0, character: 0 }]);
  assert.equal(log.partlyAccepted('u', () => 'y = 1'), undefined);
});

test('a line accepted from a multi-line item ends on the next line', () => {
  const log = new ItemLog();
  log.record('u', [{ id: 'm', text: 'def f():\n    return 1\n', line: 0, character: 0 }]);
  const lines = ['def f():', ''];
  assert.equal(log.partlyAccepted('u', doc(lines, { line: 1, character: 0 })).id, 'm');
  // CRLF documents compare equal.
  assert.equal(log.partlyAccepted('u', () => 'def f():\r\n    ret').id, 'm');
});

test('the newest answer wins; old answers are dropped', () => {
  const log = new ItemLog(2);
  log.record('u', [{ id: 'old', text: 'ab', line: 0, character: 0 }]);
  log.record('u', [{ id: 'mid', text: 'abc', line: 0, character: 0 }]);
  assert.equal(log.partlyAccepted('u', () => 'ab').id, 'mid');
  log.record('u', [{ id: 'new', text: 'xyz', line: 0, character: 0 }]);
  assert.equal(log.partlyAccepted('u', () => 'ab').id, 'mid');
  log.record('u', [{ id: 'newer', text: 'xyz', line: 0, character: 0 }]);
  assert.equal(log.partlyAccepted('u', () => 'ab'), undefined);
  log.record('u', []);
  assert.equal(log.partlyAccepted('u', () => 'xy').id, 'newer');
  log.forget('u');
  assert.equal(log.partlyAccepted('u', () => 'xy'), undefined);
});

test('an ID is reported as shown once', () => {
  const log = new ItemLog(4, 2);
  assert.equal(log.markShown('a'), true);
  assert.equal(log.markShown('a'), false);
  log.markShown('b');
  log.markShown('c'); // forgets 'a', the oldest
  assert.equal(log.markShown('c'), false);
  assert.equal(log.markShown('a'), true);
});
