// Turns the server's `wdLsp/status` notification into status bar text.
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

export function formatLatency(ms: number | null | undefined): string | null {
  if (typeof ms !== 'number' || !Number.isFinite(ms)) return null;
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

export function statusView(params: StatusParams): StatusView {
  const state: EngineState = params.state in ICONS ? params.state : 'error';
  const latency = formatLatency(params.lastLatencyMs);
  let text = `${ICONS[state]} wd-lsp`;
  if (state === 'ready' && latency) text += ` ${latency}`;
  else if (state !== 'ready') text += ` ${state}`;
  const lines = [`wd-lsp: ${state}`];
  if (params.message) lines.push(params.message);
  if (latency) lines.push(`last completion: ${latency}`);
  lines.push('Click for status; the wd-lsp commands toggle, restart and show the log.');
  return { text, tooltip: lines.join('\n'), error: state === 'error' };
}
