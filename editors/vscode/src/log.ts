// Puts the server's stderr lines into the output channel at their own level.
// No `vscode` import: unit-tested under plain Node.

export type LogLevel = 'debug' | 'info' | 'warn' | 'error';

// The server logs `%(asctime)s %(levelname)s %(name)s: %(message)s` (wd_lsp/__main__.py).
const RECORD = /^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)? (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$/;

const LEVELS: Record<string, LogLevel> = {
  DEBUG: 'debug',
  INFO: 'info',
  WARNING: 'warn',
  ERROR: 'error',
  CRITICAL: 'error',
};

export interface LogLine {
  level: LogLevel;
  text: string;
  /** The record's message without its logger's name (the whole line for other lines). */
  message: string;
}

/**
 * Reads stderr line by line. A log record's line gets its record's level, without the server's
 * timestamp (the output channel adds its own); the lines that follow it (a traceback, a message
 * with line breaks) keep that level. A bare `Traceback` (an uncaught exception) is an error; other
 * text before the first record is a warning.
 */
export class StderrLevels {
  private level: LogLevel = 'warn';

  line(raw: string): LogLine {
    const record = RECORD.exec(raw);
    if (record) {
      this.level = LEVELS[record[1]];
      const named = /^[\w.]+: (.*)$/.exec(record[2]);
      return { level: this.level, text: record[2], message: named ? named[1] : record[2] };
    }
    if (raw.startsWith('Traceback (most recent call last)')) this.level = 'error';
    return { level: this.level, text: raw, message: raw };
  }
}

/**
 * The server sends its messages for people both as `window/logMessage` and as log records on
 * stderr, over two pipes in no fixed order: the second copy of a message within `windowMs` is
 * dropped.
 */
export class LogDedupe {
  private readonly recent = new Map<string, { source: string; at: number }>();

  constructor(
    private readonly windowMs = 5000,
    private readonly now: () => number = Date.now,
  ) {}

  /** True when `message` already came from the other source just now. */
  duplicate(source: 'stderr' | 'lsp', message: string): boolean {
    const at = this.now();
    const seen = this.recent.get(message);
    if (seen && seen.source !== source && at - seen.at <= this.windowMs) {
      this.recent.delete(message);
      return true;
    }
    this.recent.set(message, { source, at });
    if (this.recent.size > 256) {
      for (const [key, value] of this.recent) if (at - value.at > this.windowMs) this.recent.delete(key);
    }
    return false;
  }
}
