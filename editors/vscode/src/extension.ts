// wd-lsp for VS Code: starts the `wd-lsp` language server over stdio and lets
// vscode-languageclient (>= 10.0.1, which registers inline completion by default)
// turn its `textDocument/inlineCompletion` answers into ghost text.
import * as vscode from 'vscode';
import {
  ExecuteCommandRequest,
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  State,
  TransportKind,
} from 'vscode-languageclient/node';
import { configurationPayload, launchSettings, needsRestart, ServerSettings, serverSettings } from './config';
import { StatusParams, statusView } from './status';

const SECTION = 'wdLsp';
// Client-side command ids use `wd-lsp.`: vscode-languageclient registers the server's own
// executeCommand ids (`wdLsp.status`, `wdLsp.restartEngine`) as VS Code commands, and
// registering the same id twice throws.
const CMD = {
  toggle: 'wd-lsp.toggle',
  restartEngine: 'wd-lsp.restartEngine',
  restartServer: 'wd-lsp.restartServer',
  showLog: 'wd-lsp.showLog',
  showStatus: 'wd-lsp.showStatus',
};

let client: LanguageClient | undefined;
let output: vscode.LogOutputChannel;
let statusItem: vscode.StatusBarItem;
// What the running server was last told, to spot settings that were removed.
let sent: ServerSettings | undefined;

function getter(): (key: string) => unknown {
  const config = vscode.workspace.getConfiguration(SECTION);
  return (key) => config.get(key);
}

function showStatus(params: StatusParams): void {
  const view = statusView(params);
  statusItem.text = view.text;
  statusItem.tooltip = view.tooltip;
  statusItem.backgroundColor = view.error ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
  statusItem.show();
}

function createClient(): LanguageClient {
  const launch = launchSettings(getter());
  const serverOptions: ServerOptions = {
    command: launch.command,
    args: launch.args,
    transport: TransportKind.stdio,
    options: { env: { ...process.env, ...launch.env } },
  };
  sent = serverSettings(getter());
  const clientOptions: LanguageClientOptions = {
    // Every file: the server filters by `enabledLanguages` itself, so changing that setting
    // needs no restart.
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: sent,
    outputChannel: output,
    traceOutputChannel: output,
    middleware: {
      // The server's textDocument/completion is for clients without inline completion; here it
      // would only repeat the ghost text in the suggest widget.
      provideCompletionItem: () => undefined,
    },
  };
  const c = new LanguageClient('wdLsp', 'wd-lsp', serverOptions, clientOptions);
  c.onNotification('wdLsp/status', (params: StatusParams) => showStatus(params));
  c.onDidChangeState((e) => {
    if (e.newState === State.Starting) showStatus({ state: 'starting', message: 'starting the language server' });
    if (e.newState === State.Stopped) showStatus({ state: 'error', message: 'the language server is not running' });
  });
  return c;
}

async function startClient(): Promise<void> {
  client = createClient();
  try {
    await client.start();
  } catch (err) {
    const command = launchSettings(getter()).command;
    const message = `wd-lsp: could not start \`${command}\` (${err instanceof Error ? err.message : String(err)}).`;
    output.appendLine(message);
    showStatus({ state: 'error', message });
    const choice = await vscode.window.showErrorMessage(
      `${message} Install it (pip install wd-lsp) or set wdLsp.server.path.`,
      'Open Settings',
      'Show Log',
    );
    if (choice === 'Open Settings') {
      await vscode.commands.executeCommand('workbench.action.openSettings', 'wdLsp.server');
    } else if (choice === 'Show Log') {
      output.show(true);
    }
  }
}

async function stopClient(): Promise<void> {
  const c = client;
  client = undefined;
  if (c && c.state !== State.Stopped) {
    await c.stop().catch((err) => output.appendLine(`wd-lsp: stop failed: ${String(err)}`));
  }
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
    await stopClient();
    await startClient();
    return;
  }
  if (!settings.enabled) showStatus({ state: 'disabled', message: 'completions are off' });
  if (client?.state === State.Running) {
    sent = settings;
    await client.sendNotification('workspace/didChangeConfiguration', configurationPayload(settings));
  }
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
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
    vscode.commands.registerCommand(CMD.restartServer, async () => {
      await stopClient();
      await startClient();
    }),
    vscode.commands.registerCommand(CMD.showLog, () => output.show(true)),
    vscode.commands.registerCommand(CMD.showStatus, async () => {
      try {
        const status = await executeServerCommand('wdLsp.status');
        output.appendLine(`wd-lsp status: ${JSON.stringify(status, null, 2)}`);
        const summary = Object.entries((status ?? {}) as Record<string, unknown>)
          .map(([k, v]) => `${k}: ${typeof v === 'object' ? JSON.stringify(v) : String(v)}`)
          .join(' · ');
        const choice = await vscode.window.showInformationMessage(`wd-lsp — ${summary}`, 'Show Log', 'Toggle');
        if (choice === 'Show Log') output.show(true);
        if (choice === 'Toggle') await vscode.commands.executeCommand(CMD.toggle);
      } catch (err) {
        const choice = await vscode.window.showWarningMessage(
          `wd-lsp: ${err instanceof Error ? err.message : String(err)}`,
          'Show Log',
          'Restart Server',
        );
        if (choice === 'Show Log') output.show(true);
        if (choice === 'Restart Server') await vscode.commands.executeCommand(CMD.restartServer);
      }
    }),
    vscode.workspace.onDidChangeConfiguration((e) => void onConfigurationChanged(e)),
  );

  showStatus({ state: 'starting', message: 'starting the language server' });
  await startClient();
}

export async function deactivate(): Promise<void> {
  await stopClient();
}
