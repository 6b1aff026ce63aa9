// wd-lsp for VS Code: starts the `wd-lsp` language server over stdio and lets
// vscode-languageclient (>= 10.0.1, which registers inline completion by default)
// turn its `textDocument/inlineCompletion` answers into ghost text.
import * as readline from 'node:readline';
import type { Readable } from 'node:stream';
import * as vscode from 'vscode';
import {
  ExecuteCommandRequest,
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  State,
  TransportKind,
} from 'vscode-languageclient/node';
import { ACCEPTED, ItemLog, itemId, SHOWN, TrackedItem } from './acceptance';
import {
  configurationPayload,
  findExecutable,
  LaunchSettings,
  launchSettings,
  needsRestart,
  ServerSettings,
  serverSettings,
} from './config';
import { LogDedupe, StderrLevels } from './log';
import { StatusParams, statusSummary, StatusTracker } from './status';

const SECTION = 'wdLsp';
// Client-side command ids use `wd-lsp.`: vscode-languageclient registers the server's own
// executeCommand ids (`wdLsp.status`, `wdLsp.restartEngine`, ...) as VS Code commands, and
// registering the same id twice throws.
const CMD = {
  toggle: 'wd-lsp.toggle',
  restartEngine: 'wd-lsp.restartEngine',
  restartServer: 'wd-lsp.restartServer',
  showLog: 'wd-lsp.showLog',
  showStatus: 'wd-lsp.showStatus',
  trigger: 'wd-lsp.trigger',
  acceptNextWord: 'wd-lsp.acceptNextWord',
  acceptNextLine: 'wd-lsp.acceptNextLine',
  acceptWithSuggestion: 'wd-lsp.acceptWithSuggestion',
};

const dedupe = new LogDedupe();

/**
 * Start-up failures are told once, by `reportStartFailure`: vscode-languageclient would show its
 * own error notification for the same failure as well. The server's `window/logMessage` lines
 * come through these methods too, and a copy of one already taken from stderr is dropped.
 */
class WdClient extends LanguageClient {
  starting = false;

  override error(message: string, data?: unknown, showNotification: boolean | 'force' = true): void {
    if (!dedupe.duplicate('lsp', message)) super.error(message, data, this.starting ? false : showNotification);
  }

  override warn(message: string, data?: unknown, showNotification = true): void {
    if (!dedupe.duplicate('lsp', message)) super.warn(message, data, showNotification);
  }

  override info(message: string, data?: unknown, showNotification = true): void {
    if (!dedupe.duplicate('lsp', message)) super.info(message, data, showNotification);
  }

  override debug(message: string, data?: unknown, showNotification = true): void {
    if (!dedupe.duplicate('lsp', message)) super.debug(message, data, showNotification);
  }
}

let client: WdClient | undefined;
let output: vscode.LogOutputChannel;
let statusItem: vscode.StatusBarItem;
const tracker = new StatusTracker();
const items = new ItemLog();
// What the running server was last told, to spot settings that were removed.
let sent: ServerSettings | undefined;
// The last start-up failure told in a notification: the same one is not told again.
let toldFailure: string | undefined;

function getter(): (key: string) => unknown {
  const config = vscode.workspace.getConfiguration(SECTION);
  return (key) => config.get(key);
}

function showStatus(params: StatusParams): void {
  const view = tracker.update(params);
  statusItem.text = view.text;
  statusItem.tooltip = view.tooltip;
  statusItem.backgroundColor = view.error ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
  statusItem.show();
}

function pipeLines(input: Readable, onLine: (line: string) => void): void {
  readline.createInterface({ input, crlfDelay: Infinity, terminal: false, historySize: 0 }).on('line', onLine);
}

/** Tells the server about an item (`wdLsp.shown` / `wdLsp.accepted`); failures only go to the log. */
function tellServer(command: string, arg: { id: string; kind?: string }): void {
  const c = client;
  if (!c || c.state !== State.Running) return;
  c.sendRequest(ExecuteCommandRequest.type, { command, arguments: [arg] }).then(undefined, (err: unknown) =>
    output.debug(`${command} failed: ${err instanceof Error ? err.message : String(err)}`),
  );
}

function tellShown(id: string): void {
  if (items.markShown(id)) tellServer(SHOWN, { id });
}

function tracked(item: vscode.InlineCompletionItem, position: vscode.Position): TrackedItem | undefined {
  const id = itemId(item.command);
  if (!id) return undefined;
  const start = item.range?.start ?? position;
  const text = typeof item.insertText === 'string' ? item.insertText : item.insertText.value;
  return { id, text, line: start.line, character: start.character };
}

function createClient(launch: LaunchSettings, env: NodeJS.ProcessEnv): WdClient {
  const serverOptions: ServerOptions = {
    command: launch.command,
    args: launch.args,
    transport: TransportKind.stdio,
    options: { env },
  };
  sent = serverSettings(getter());
  const clientOptions: LanguageClientOptions = {
    // Every file: the server filters by `enabledLanguages` itself, so changing that setting
    // needs no restart.
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: sent,
    outputChannel: output,
    traceOutputChannel: output,
    stdioOptions: {
      stdout: (input, channel) => pipeLines(input, (line) => channel.info(line)),
      // The server logs at every level to stderr: not every line is an error.
      stderr: (input, channel) => {
        const levels = new StderrLevels();
        pipeLines(input, (raw) => {
          const { level, text, message } = levels.line(raw);
          if (!dedupe.duplicate('stderr', message)) channel[level](text);
        });
      },
    },
    middleware: {
      // The server's textDocument/completion is for clients without inline completion; here it
      // would only repeat the ghost text in the suggest widget.
      provideCompletionItem: () => undefined,
      provideInlineCompletionItems: async (document, position, context, token, next) => {
        const version = document.version;
        const result = await next(document, position, context, token);
        if (!result || token.isCancellationRequested) return result;
        const list = (Array.isArray(result) ? result : result.items)
          .map((item) => tracked(item, position))
          .filter((item): item is TrackedItem => item !== undefined);
        items.record(document.uri.toString(), list);
        // The stable API does not say when ghost text is drawn: an answer to the text still on
        // screen shows its first item.
        if (list.length > 0 && document.version === version) tellShown(list[0].id);
        return result;
      },
      executeCommand: (command, args, next) => {
        // VS Code runs an accepted item's command; the item was on screen, whether or not its
        // answer was counted as shown.
        if (command === ACCEPTED) {
          const id = args[0] && typeof args[0] === 'object' ? (args[0] as { id?: unknown }).id : undefined;
          if (typeof id === 'string') {
            tellShown(id);
            acceptedDuringPart?.add(id);
          }
        }
        return next(command, args);
      },
    },
  };
  const c = new WdClient('wdLsp', 'wd-lsp', serverOptions, clientOptions);
  c.onNotification('wdLsp/status', (params: StatusParams) => showStatus(params));
  c.onDidChangeState((e) => {
    if (e.newState === State.Starting) showStatus({ state: 'starting', message: 'starting the language server' });
    if (e.newState === State.Stopped) showStatus({ state: 'error', message: 'the language server is not running' });
  });
  return c;
}

/** Opens the settings where `wdLsp.server.path` can be set for this window. */
async function openServerSettings(): Promise<void> {
  const query = `${SECTION}.server.path`;
  const where = vscode.workspace.getConfiguration(SECTION).inspect('server.path');
  let command = 'workbench.action.openSettings';
  if (where?.workspaceFolderValue !== undefined || where?.workspaceValue !== undefined) {
    command = 'workbench.action.openWorkspaceSettings';
  } else if (vscode.env.remoteName) {
    // The server runs on the remote machine; the User tab hides machine-scoped settings there.
    command = 'workbench.action.openRemoteSettings';
  }
  await vscode.commands.executeCommand(command, { query });
}

/** One notification per distinct failure, never awaited: activation and commands go on. */
function reportStartFailure(reason: string): void {
  const message = `wd-lsp: could not start the language server: ${reason}.`;
  output.error(message);
  showStatus({ state: 'error', message });
  if (toldFailure === message) return;
  toldFailure = message;
  void vscode.window
    .showErrorMessage(
      `${message} Install wd-lsp (see its README) or set "wd-lsp › Server: Path" to the full path of the command.`,
      'Open Settings',
      'Show Log',
    )
    .then(async (choice) => {
      if (choice === 'Open Settings') await openServerSettings();
      else if (choice === 'Show Log') output.show(true);
    });
}

async function startClient(): Promise<void> {
  const launch = launchSettings(getter());
  const env = { ...process.env, ...launch.env };
  if (!findExecutable(launch.command, env)) {
    const where = launch.command.includes('/') || launch.command.includes('\\') ? '' : ' on PATH';
    reportStartFailure(`\`${launch.command}\` was not found${where}`);
    return;
  }
  const c = createClient(launch, env);
  client = c;
  c.starting = true;
  try {
    await c.start();
    toldFailure = undefined;
  } catch (err) {
    if (client === c) reportStartFailure(`\`${launch.command}\`: ${err instanceof Error ? err.message : String(err)}`);
  } finally {
    c.starting = false;
  }
}

async function stopClient(): Promise<void> {
  const c = client;
  client = undefined;
  if (c && c.state !== State.Stopped) {
    await c.stop().catch((err) => output.warn(`stopping the language server failed: ${String(err)}`));
  }
}

async function restartClient(): Promise<void> {
  await stopClient();
  await startClient();
}

async function executeServerCommand(command: string): Promise<unknown> {
  if (!client || client.state !== State.Running) {
    throw new Error('the language server is not running');
  }
  return client.sendRequest(ExecuteCommandRequest.type, { command, arguments: [] });
}

async function onConfigurationChanged(e: vscode.ConfigurationChangeEvent): Promise<void> {
  if (!e.affectsConfiguration(SECTION)) return;
  const settings = serverSettings(getter());
  // A new command, arguments or environment means a new process; so does an unset key.
  if (e.affectsConfiguration(`${SECTION}.server`) || (sent && needsRestart(sent, settings))) {
    await restartClient();
    return;
  }
  if (!settings.enabled) showStatus({ state: 'disabled', message: 'completions are off' });
  if (client?.state === State.Running) {
    sent = settings;
    await client.sendNotification('workspace/didChangeConfiguration', configurationPayload(settings));
  }
}

// Set while a partial accept runs: the items whose accept command VS Code ran meanwhile.
let acceptedDuringPart: Set<string> | undefined;

/**
 * VS Code's accept-next-word / accept-next-line, then `wdLsp.accepted` with that kind for the
 * item it took from (the stable API does not report partial accepts to the provider).
 */
async function acceptPart(kind: 'word' | 'line'): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const before = editor?.document.version;
  // Items VS Code accepted whole during this accept (it runs their command).
  const acceptedWhole = new Set<string>();
  acceptedDuringPart = acceptedWhole;
  try {
    await vscode.commands.executeCommand(
      kind === 'word' ? 'editor.action.inlineSuggest.acceptNextWord' : 'editor.action.inlineSuggest.acceptNextLine',
    );
  } finally {
    acceptedDuringPart = undefined;
  }
  if (!editor || editor.document.version === before) return;
  const document = editor.document;
  const cursor = editor.selection.active;
  const item = items.partlyAccepted(document.uri.toString(), (line, character) =>
    line < document.lineCount && cursor.isAfterOrEqual(new vscode.Position(line, character))
      ? document.getText(new vscode.Range(line, character, cursor.line, cursor.character))
      : null,
    acceptedWhole,
  );
  if (item) tellServer(ACCEPTED, { id: item.id, kind });
}

async function showStatusSummary(): Promise<void> {
  try {
    const status = await executeServerCommand('wdLsp.status');
    output.info(`status: ${JSON.stringify(status)}`);
    const summary = statusSummary(status);
    const enabled = vscode.workspace.getConfiguration(SECTION).get<boolean>('enabled') !== false;
    const toggle = enabled ? 'Turn Off' : 'Turn On';
    const choice = await vscode.window.showInformationMessage(
      summary.title,
      { modal: true, detail: summary.lines.join('\n') },
      'Show Log',
      'Restart Engine',
      toggle,
    );
    if (choice === 'Show Log') output.show(true);
    else if (choice === 'Restart Engine') await vscode.commands.executeCommand(CMD.restartEngine);
    else if (choice === toggle) await vscode.commands.executeCommand(CMD.toggle);
  } catch (err) {
    const choice = await vscode.window.showWarningMessage(
      `wd-lsp: ${err instanceof Error ? err.message : String(err)}`,
      'Show Log',
      'Restart Server',
    );
    if (choice === 'Show Log') output.show(true);
    if (choice === 'Restart Server') await vscode.commands.executeCommand(CMD.restartServer);
  }
}

export function activate(context: vscode.ExtensionContext): void {
  output = vscode.window.createOutputChannel('wd-lsp', { log: true });
  statusItem = vscode.window.createStatusBarItem('wdLsp.status', vscode.StatusBarAlignment.Right, 100);
  statusItem.name = 'wd-lsp';
  statusItem.command = CMD.showStatus;
  context.subscriptions.push(output, statusItem);

  context.subscriptions.push(
    vscode.commands.registerCommand(CMD.toggle, async () => {
      const config = vscode.workspace.getConfiguration(SECTION);
      const enabled = config.get<boolean>('enabled') !== false;
      // Write where the value currently comes from, so a workspace setting does not shadow the toggle.
      const target =
        config.inspect('enabled')?.workspaceValue !== undefined
          ? vscode.ConfigurationTarget.Workspace
          : vscode.ConfigurationTarget.Global;
      await config.update('enabled', !enabled, target);
      vscode.window.setStatusBarMessage(`wd-lsp completions ${enabled ? 'off' : 'on'}`, 2000);
    }),
    vscode.commands.registerCommand(CMD.restartEngine, async () => {
      try {
        await executeServerCommand('wdLsp.restartEngine');
      } catch (err) {
        vscode.window.showErrorMessage(`wd-lsp: restart failed: ${err instanceof Error ? err.message : String(err)}`);
      }
    }),
    vscode.commands.registerCommand(CMD.restartServer, restartClient),
    vscode.commands.registerCommand(CMD.showLog, () => output.show(true)),
    vscode.commands.registerCommand(CMD.showStatus, showStatusSummary),
    // An explicit request (trigger kind Invoked): the server answers it without its debounce.
    vscode.commands.registerCommand(CMD.trigger, () => vscode.commands.executeCommand('editor.action.inlineSuggest.trigger')),
    vscode.commands.registerCommand(CMD.acceptNextWord, () => acceptPart('word')),
    vscode.commands.registerCommand(CMD.acceptNextLine, () => acceptPart('line')),
    // Tab while the suggest widget is open and the ghost text continues its selected item: the
    // item first (with its own edits, such as an import), then the rest of the ghost text.
    vscode.commands.registerCommand(CMD.acceptWithSuggestion, async () => {
      await vscode.commands.executeCommand('acceptSelectedSuggestion');
      await vscode.commands.executeCommand('editor.action.inlineSuggest.commit');
    }),
    vscode.workspace.onDidChangeConfiguration((e) => void onConfigurationChanged(e)),
    vscode.workspace.onDidCloseTextDocument((d) => items.forget(d.uri.toString())),
  );

  showStatus({ state: 'starting', message: 'starting the language server' });
  // Not awaited: activation (and with it every command above) must not wait for the server.
  void startClient();
}

export async function deactivate(): Promise<void> {
  await stopClient();
}
