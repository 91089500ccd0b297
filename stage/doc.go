// Package stage is the SDK for pepsi-dispatch stage programs: a stage becomes a handler
// function, and the package speaks the worker protocol, holds the database connection and
// writes each message's outcome.
//
//	func main() {
//		stage.Run(func(ctx context.Context, m *stage.Message) error {
//			m.State["seen"] = true
//			return m.Advance("next-stage")
//		})
//	}
//
// The rest of this comment is the worker protocol itself, complete enough to write a stage in
// any language without this package.
//
// # Start
//
// pepsi-dispatch runs each stage's PROGRAM as long-lived worker processes, started as
//
//	PROGRAM -c CONFIG_FILE worker     (or PROGRAM worker when there is no CONFIG_FILE)
//
// with these environment variables:
//
//	PEPSI_STAGE   the stage this process serves
//	PEPSI_NEXT    the stages it may advance a message to, separated by spaces (empty: final stage)
//	PEPSI_DSN     the libpq connection string of [database] DSN
//
// The DSN carries an application_name starting with "pepsi-": keep it. The schema's requeue
// trigger skips sessions with such a name, so an advance does not wake the dispatcher through
// NOTIFY (the status line does that already). A worker connects once and keeps the connection
// for its whole life; if it breaks, the worker exits non-zero instead of reconnecting.
//
// # Standard input and output
//
// Standard input carries one decimal message id (a workqueue_id) per line. For each id, in
// order, the worker writes one line on standard output:
//
//	0                 success: the stage has committed the message's outcome
//	0 TEXT            success, with text (reports of fused stages)
//	N REASON          failure (N a non-zero decimal, this SDK uses 1): REASON, one line, is
//	                  recorded by the dispatcher in state.dispatch_error
//
// The dispatcher writes up to QUEUE_LIMIT ids at once and may write more before the first
// reply: a worker must keep reading while it works, or at least never stop answering in
// order. The dispatcher measures MAX_RUNTIME from the moment an id reaches the head of the
// worker's queue, so a worker that answers in batches should keep its batches short.
//
// On EOF on standard input the worker finishes the ids it has read, answers them and exits 0.
// Standard error goes to the dispatcher's log, tagged with the stage and the pid. Exiting
// without answering (a crash, SIGTERM, SIGKILL) is always safe: the dispatcher fails the
// message at the head of the queue and puts the others back to pending, in both cases only
// if the row is still the claim it handed out.
//
// # Processing a message
//
// When the dispatcher hands over an id, it has already set the row's status to 'running' at
// the worker's stage. The worker reads the row (payload is set at enqueue and never changes;
// state is the stage's jsonb scratchpad; attempts counts failed attempts) and, on success,
// commits exactly one outcome, as ONE UPDATE guarded by the claim, before it writes "0":
//
//	-- advance: to one of PEPSI_NEXT; the dispatcher's next claim takes it for that stage
//	UPDATE workqueue SET stage = 'NEXT', status = 'pending', state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//	-- done
//	UPDATE workqueue SET status = 'done', state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//	-- defer: the dispatcher puts it back to pending at this stage when retry_at is due
//	UPDATE workqueue SET status = 'paused', retry_at = $until, state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//
// (A fan-out split sets status = 'waiting' instead, under the same guard; see fanin.md.) If
// the UPDATE changes no row, the claim is gone (the dispatcher took the message back): roll
// back and answer non-zero. The stage's own writes belong in the same transaction, so they
// commit if and only if the outcome does. A stage never writes a failure itself: it answers
// non-zero and the dispatcher records it (attempts + 1, state.dispatch_error, paused with
// back-off or failed) under its own claim guard. A stage must not touch the statistics tables.
//
// # What this package does
//
// Run parses the command line and environment (LoadConfig), and Serve runs the loop. Every id
// already waiting on standard input (at least one, at most 64) forms one batch, run in one
// transaction:
//
//	BEGIN
//	SELECT workqueue_id, attempts, payload, state FROM workqueue
//	 WHERE workqueue_id = ANY($ids) AND status = 'running' AND stage = $stage
//	for each id, in order: the handler, its own statements inside a SAVEPOINT of its own
//	one UPDATE … FROM (VALUES …) RETURNING for the outcomes not written yet (below)
//	COMMIT
//	then all the batch's status lines, in one write
//
// An id whose row is not running at the stage is answered "1 ... (claim lost)" without running
// the handler. A handler that returns an error (or panics, or chooses no outcome, or two) fails
// its message: the SDK rolls back to the message's savepoint, so its writes and its outcome are
// undone and the other messages of the batch are not affected. If the commit fails, every
// message of the batch is answered non-zero with the reason; if the connection is lost, the
// process exits non-zero without answering, and the dispatcher recovers.
//
// One commit, that is one WAL flush, serves the whole batch, and the requests per message are
// few. The savepoint is taken lazily, in the same request as the handler's first statement on
// Message.Tx (or as its outcome), so a handler that never uses Message.Tx needs none. The
// outcome of such a handler is kept, with the state as it was when chosen, and written after
// the handler returned, together with the batch's other kept outcomes, in one statement that
// keeps each row's guard (RETURNING tells which rows it found; the others fail as claim lost).
// A batch of N messages whose handlers do not use Message.Tx thus costs 4 round trips (BEGIN,
// the load, the outcome statement, COMMIT) instead of N + 3. A handler that does use it adds
// one round trip for the SAVEPOINT, its own statements, and its outcome's UPDATE, written at
// once inside the savepoint.
package stage
