// Turns the server's `wdLsp/status` notification into status bar text and hover, and the
// `wdLsp.status` command's answer into a readable summary.
// No `vscode` import: unit-tested under plain Node.

export type EngineState = 'starting' | 'loading' | 'ready' | 'error' | 'disabled';

export interface StatusParams {
  state: EngineState;
  message?: string;
  lastLatencyMs?: number | null;
}

export interface StatusView {
  text: string;
  tooltip: string;
  /** True when the item should use the error background colour. */
  error: boolean;
}

const ICONS: Record<EngineState, string> = {
  starting: '$(loading~spin)',
  loading: '$(loading~spin)',
  ready: '$(sparkle)',
  error: '$(error)',
  disabled: '$(circle-slash)',
};

/**
 * Answers faster than this came from the server's memory of the suggestion on screen (typing
 * through it, or the request VS Code sends right after an accept), not from the engine: showing
 * them would read "0 ms" after every accept.
 */
export const MEMORY_ANSWER_MS = 5;

export function formatLatency(ms: number | null | undefined): string | null {
  if (typeof ms !== 'number' || !Number.isFinite(ms) || ms < 0) return null;
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

// The server's own "last completion N ms" message repeats the latency shown from lastLatencyMs.
function isLatencyMessage(message: string): boolean {
  return /^last completion\b/i.test(message.trim());
}

/** Status bar text and hover for one status, given the latency of the last engine answer. */
export function statusView(params: StatusParams, latencyMs: number | null = params.lastLatencyMs ?? null): StatusView {
  const state: EngineState = params.state in ICONS ? params.state : 'error';
  const latency = formatLatency(latencyMs);
  let text = `${ICONS[state]} wd-lsp`;
  if (state === 'ready' && latency) text += ` ${latency}`;
  else if (state !== 'ready') text += ` ${state}`;
  const lines = [`wd-lsp: ${state}`];
  const message = (params.message ?? '').trim();
  if (message && !isLatencyMessage(message)) lines.push(message);
  if (latency) lines.push(`Last completion: ${latency}`);
  lines.push('Click for the status summary.');
  return { text, tooltip: lines.join('\n'), error: state === 'error' };
}

/** Keeps the latency of the last answer that came from the engine across status notifications. */
export class StatusTracker {
  private latencyMs: number | null = null;

  update(params: StatusParams): StatusView {
    const ms = params.lastLatencyMs;
    if (typeof ms === 'number' && Number.isFinite(ms) && ms >= MEMORY_ANSWER_MS) this.latencyMs = ms;
    return statusView(params, this.latencyMs);
  }
}

export interface LanguageAcceptance {
  shown?: number;
  accepted?: number;
  partialWord?: number;
  partialLine?: number;
}

export interface StatusSummary {
  title: string;
  lines: string[];
}

function count(value: unknown): number {
  return typeof value === 'number' && Number.isFinite(value) ? value : 0;
}

/** One line per language: "python: 12 shown, 5 accepted (42%), 2 by word, 1 by line". */
export function acceptanceLines(acceptance: unknown): string[] {
  if (!acceptance || typeof acceptance !== 'object') return [];
  return Object.entries(acceptance as Record<string, LanguageAcceptance>)
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([language, c]) => {
      const shown = count(c?.shown);
      const accepted = count(c?.accepted);
      const rate = shown > 0 ? ` (${Math.round((100 * accepted) / shown)}%)` : '';
      const parts = [`${shown} shown`, `${accepted} accepted${rate}`];
      if (count(c?.partialWord)) parts.push(`${count(c?.partialWord)} by word`);
      if (count(c?.partialLine)) parts.push(`${count(c?.partialLine)} by line`);
      return `${language}: ${parts.join(', ')}`;
    });
}

/** The `wdLsp.status` answer as a title and short lines, for people. */
export function statusSummary(status: unknown): StatusSummary {
  const s = (status && typeof status === 'object' ? status : {}) as Record<string, unknown>;
  const state = typeof s.engine === 'string' ? s.engine : 'unknown';
  const lines: string[] = [];
  if (typeof s.model === 'string' && s.model) lines.push(`Model: ${s.model}`);
  if (s.enabled === false) lines.push('Completions: off (wd-lsp: Toggle Completions)');
  if (typeof s.engineError === 'string' && s.engineError) lines.push(`Engine error: ${s.engineError}`);
  else if (state !== 'ready' && typeof s.engineMessage === 'string' && s.engineMessage) {
    lines.push(`Engine: ${s.engineMessage}`);
  }
  const lastMs = typeof s.lastLatencyMs === 'number' && s.lastLatencyMs >= MEMORY_ANSWER_MS ? s.lastLatencyMs : null;
  const last = formatLatency(lastMs);
  const median = formatLatency(s.p50LatencyMs as number | undefined);
  if (last || median) {
    lines.push(`Latency: ${[last && `last ${last}`, median && `median ${median}`].filter(Boolean).join(', ')}`);
  }
  const accepted = acceptanceLines(s.acceptance);
  if (accepted.length) {
    lines.push('Suggestions this session (counted on this machine only):', ...accepted.map((l) => `  ${l}`));
  } else {
    lines.push('Suggestions this session: none shown yet');
  }
  if (typeof s.version === 'string') lines.push(`Server: wd-lsp ${s.version}`);
  return { title: `wd-lsp: ${state}`, lines };
}
