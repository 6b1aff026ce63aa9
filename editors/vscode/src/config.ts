// Maps the extension's `wdLsp.*` settings to the server's configuration object.
// Kept free of the `vscode` module so that it can be unit-tested under plain Node.

/**
 * The server's configuration, sent as `initializationOptions` and in didChangeConfiguration.
 * Unset optional keys are left out rather than sent as null: the server then keeps its own
 * default (e.g. $WD_LSP_MODEL for the model).
 */
export interface ServerSettings {
  enabled: boolean;
  model?: string;
  engine?: { socket?: string; tcp?: string; token?: string };
  debounceMs: number;
  maxTokens: number;
  multiline: 'auto' | 'single' | 'multi';
  enabledLanguages: string[];
  temperature: number;
  beams: number;
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
    debounceMs: Math.round(num(get('debounceMs'), 60, 0)),
    maxTokens: Math.round(num(get('maxTokens'), 64, 1)),
    multiline: multiline === 'single' || multiline === 'multi' ? multiline : 'auto',
    enabledLanguages:
      Array.isArray(languages) && languages.length > 0
        ? languages.filter((l): l is string => typeof l === 'string')
        : ['*'],
    temperature: num(get('temperature'), 0, 0),
    beams: Math.min(8, Math.round(num(get('beams'), 2, 1))),
    ...(backend !== null ? { backend } : {}),
    ...(Object.keys(openai).length > 0 ? { openai } : {}),
  };
}

export function launchSettings(get: Getter): LaunchSettings {
  const args = get('server.args');
  const env = get('server.env');
  return {
    command: optString(get('server.path')) ?? 'wd-lsp',
    args: Array.isArray(args) ? args.map(String) : [],
    env:
      env && typeof env === 'object'
        ? Object.fromEntries(Object.entries(env as Record<string, unknown>).map(([k, v]) => [k, String(v)]))
        : {},
  };
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
