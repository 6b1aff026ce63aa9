// Maps the extension's `wdLsp.*` settings to the server's configuration object.
// Kept free of the `vscode` module so that it can be unit-tested under plain Node.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

/**
 * The server's configuration, sent as `initializationOptions` and in didChangeConfiguration.
 * Unset optional keys are left out rather than sent as null: the server then keeps its own
 * default (e.g. $WD_LSP_MODEL for the model).
 */
export interface ServerSettings {
  enabled: boolean;
  model?: string;
  engine?: { socket?: string; tcp?: string; token?: string };
  debounce: 'adaptive' | 'fixed';
  debounceMs: number;
  maxTokens: number;
  multiline: 'auto' | 'single' | 'multi';
  enabledLanguages: string[];
  temperature: number;
  beams: number;
  suggestions: number;
  backend?: 'engine' | 'openai';
  openai?: { baseUrl?: string; apiKey?: string; model?: string; fim?: 'template' | 'suffix' };
}

/** How to start the server process; client-side only, never sent to the server. */
export interface LaunchSettings {
  command: string;
  args: string[];
  env: Record<string, string>;
}

/** Reads one setting below `wdLsp.` (e.g. `engine.tcp`); undefined when unset. */
export type Getter = (key: string) => unknown;

// Empty strings from the settings UI mean "not set": the server then uses its own default.
function optString(value: unknown): string | null {
  return typeof value === 'string' && value.trim() !== '' ? value.trim() : null;
}

function num(value: unknown, fallback: number, min: number): number {
  return typeof value === 'number' && Number.isFinite(value) ? Math.max(min, value) : fallback;
}

export function serverSettings(get: Getter): ServerSettings {
  const multiline = get('multiline');
  const languages = get('enabledLanguages');
  const engine: NonNullable<ServerSettings['engine']> = {};
  for (const key of ['socket', 'tcp', 'token'] as const) {
    const value = optString(get(`engine.${key}`));
    if (value !== null) engine[key] = value;
  }
  const model = optString(get('model'));
  // An OpenAI-compatible server (vLLM, SGLang, llama.cpp) instead of the resident engine.
  const backend = get('backend') === 'openai' ? 'openai' : null;
  const openai: NonNullable<ServerSettings['openai']> = {};
  for (const key of ['baseUrl', 'apiKey', 'model'] as const) {
    const value = optString(get(`openai.${key}`));
    if (value !== null) openai[key] = value;
  }
  const fim = get('openai.fim');
  if (fim === 'template' || fim === 'suffix') openai.fim = fim;
  return {
    enabled: get('enabled') !== false,
    ...(model !== null ? { model } : {}),
    ...(Object.keys(engine).length > 0 ? { engine } : {}),
    debounce: get('debounce') === 'fixed' ? 'fixed' : 'adaptive',
    debounceMs: Math.round(num(get('debounceMs'), 60, 0)),
    maxTokens: Math.round(num(get('maxTokens'), 64, 1)),
    multiline: multiline === 'single' || multiline === 'multi' ? multiline : 'auto',
    enabledLanguages:
      Array.isArray(languages) && languages.length > 0
        ? languages.filter((l): l is string => typeof l === 'string')
        : ['*'],
    temperature: num(get('temperature'), 0, 0),
    beams: Math.min(8, Math.round(num(get('beams'), 2, 1))),
    suggestions: Math.min(8, Math.round(num(get('suggestions'), 3, 1))),
    ...(backend !== null ? { backend } : {}),
    ...(Object.keys(openai).length > 0 ? { openai } : {}),
  };
}

export function launchSettings(get: Getter): LaunchSettings {
  const args = get('server.args');
  const env = get('server.env');
  return {
    command: expandHome(optString(get('server.path')) ?? 'wd-lsp'),
    args: Array.isArray(args) ? args.map(String) : [],
    env:
      env && typeof env === 'object'
        ? Object.fromEntries(Object.entries(env as Record<string, unknown>).map(([k, v]) => [k, String(v)]))
        : {},
  };
}

// A shell would expand `~/`; spawning the command directly does not.
function expandHome(command: string): string {
  return command === '~' || command.startsWith('~/') ? path.join(os.homedir(), command.slice(1)) : command;
}

function runnable(file: string, windows: boolean): boolean {
  try {
    if (!fs.statSync(file).isFile()) return false;
    if (!windows) fs.accessSync(file, fs.constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/**
 * Whether the server command can be started: a bare name is looked up on the PATH of `env` (as
 * spawning it will), an absolute path checked as it is. Null when it can't; a relative path with a
 * directory in it resolves against a working directory not known here, and is left to the spawn.
 */
export function findExecutable(
  command: string,
  env: Record<string, string | undefined>,
  platform: string = process.platform,
): string | null {
  const windows = platform === 'win32';
  const p = windows ? path.win32 : path.posix;
  const key = (name: string) => Object.keys(env).find((k) => (windows ? k.toUpperCase() === name : k === name));
  const extensions = windows
    ? ['', ...(env[key('PATHEXT') ?? ''] ?? '.COM;.EXE;.BAT;.CMD').split(';').filter(Boolean)]
    : [''];
  const variants = (file: string) => (windows && p.extname(file) === '' ? extensions : ['']).map((e) => file + e);
  if (p.isAbsolute(command)) return variants(command).find((f) => runnable(f, windows)) ?? null;
  if (command.includes('/') || (windows && command.includes('\\'))) return command;
  const dirs = (env[key('PATH') ?? ''] ?? '').split(p.delimiter).filter(Boolean);
  for (const dir of dirs) {
    const found = variants(p.join(dir, command)).find((f) => runnable(f, windows));
    if (found) return found;
  }
  return null;
}

/** The didChangeConfiguration payload the server expects. */
export function configurationPayload(settings: ServerSettings): { settings: { wdLsp: ServerSettings } } {
  return { settings: { wdLsp: settings } };
}

/**
 * True when a key that was sent before is now unset. The server merges settings, so it would keep
 * the old value: only a fresh server process goes back to its default.
 */
export function needsRestart(previous: ServerSettings, next: ServerSettings): boolean {
  const dropped = (a: object | undefined, b: object | undefined) =>
    Object.keys(a ?? {}).some((k) => !(k in (b ?? {})));
  return dropped(previous, next) || dropped(previous.engine, next.engine) || dropped(previous.openai, next.openai);
}
