// Which of the server's inline items is on screen, for the local acceptance statistics: the
// server counts `wdLsp.shown` and `wdLsp.accepted` (kind full/word/line) per item ID.
// No `vscode` import: unit-tested under plain Node.

export const ACCEPTED = 'wdLsp.accepted';
export const SHOWN = 'wdLsp.shown';

/** An inline item as the server sent it: its ID, text and where its range starts. */
export interface TrackedItem {
  id: string;
  text: string;
  line: number;
  character: number;
}

/** The item ID in the `wdLsp.accepted` command every server item carries. */
export function itemId(command: unknown): string | undefined {
  if (!command || typeof command !== 'object') return undefined;
  const c = command as { command?: unknown; arguments?: unknown };
  const first = c.command === ACCEPTED && Array.isArray(c.arguments) ? c.arguments[0] : undefined;
  const id = first && typeof first === 'object' ? (first as { id?: unknown }).id : undefined;
  return typeof id === 'string' ? id : undefined;
}

const normalize = (text: string) => text.replace(/\r\n?/g, '\n');

/** Reads the document from a position to the cursor; null when that is not possible. */
export type TextToCursor = (line: number, character: number) => string | null;

/**
 * The last few answers per document, newest first, and the IDs already reported as shown (each at
 * most once, as the server counts them).
 */
export class ItemLog {
  private readonly answers = new Map<string, TrackedItem[][]>();
  private readonly shownIds = new Set<string>();

  constructor(
    private readonly answersKept = 4,
    private readonly shownKept = 1024,
  ) {}

  record(uri: string, items: TrackedItem[]): void {
    if (items.length === 0) return;
    const list = [items, ...(this.answers.get(uri) ?? [])].slice(0, this.answersKept);
    this.answers.delete(uri); // re-insert: the map's order is the documents' recency
    this.answers.set(uri, list);
    while (this.answers.size > 64) this.answers.delete(this.answers.keys().next().value as string);
  }

  forget(uri: string): void {
    this.answers.delete(uri);
  }

  /**
   * The item a partial accept just took from: the first of the newest answer whose text goes on
   * from what now stands between its start and the cursor. Items of one answer all start alike,
   * so the accepted part tells them apart; where it doesn't, they are of one request (and one
   * language), which is all the statistics keep. Undefined when no item fits, or when the accept
   * took a whole item: VS Code then accepts it as a whole and runs its command, so an item whose
   * command ran during the accept (`acceptedWhole`) ends the search. An item that the typed text
   * merely equals, with no command run, was not the one on screen when a longer one goes on.
   */
  partlyAccepted(
    uri: string,
    textToCursor: TextToCursor,
    acceptedWhole: ReadonlySet<string> = new Set(),
  ): TrackedItem | undefined {
    for (const items of this.answers.get(uri) ?? []) {
      let found: TrackedItem | undefined;
      let whole = false;
      for (const item of items) {
        const typed = textToCursor(item.line, item.character);
        if (typed === null) continue;
        const text = normalize(item.text);
        const done = normalize(typed);
        if (text === done) {
          if (acceptedWhole.has(item.id)) return undefined;
          whole = true;
        } else if (!found && text.startsWith(done)) found = item;
      }
      if (found) return found;
      if (whole) return undefined;
    }
    return undefined;
  }

  /** True the first time an ID is reported as shown. */
  markShown(id: string): boolean {
    if (this.shownIds.has(id)) return false;
    this.shownIds.add(id);
    if (this.shownIds.size > this.shownKept) this.shownIds.delete(this.shownIds.values().next().value as string);
    return true;
  }
}
