// fuse.go: stage fusion (ServeStages): a message's place in its pass, and the running of a
// fused stage's handler after the advance that leads to it, in a savepoint of its own.
//
// It writes only the move of the running row to the fused stage (sent by conn.go with the
// savepoint); a fused stage's outcome is written as any other, by outcome.go.

package stage

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"slices"
	"strconv"
	"time"

	"github.com/lib/pq"
)

// link is a Message's place in the pass of its row: the claimed stage first, then the stages
// fused after it, each run by runLink. Set before the handler runs, except took.
type link struct {
	index  int           // the message's index in the batch, for savepoint names
	prev   *Message      // the stage whose advance led here; nil for the claimed stage
	chain  []string      // the stages of the pass so far, this one last: none is fused twice
	at     string        // the stage the row is at in the transaction when this stage starts
	nested bool          // an earlier stage of the pass has its savepoint open: this one's nests in it, and its outcome is written at once
	took   time.Duration // the handler's running time
}

// fusable reports whether the outcome c, chosen by m's handler, is an advance to a stage that
// runs in the same pass: one this program implements (a view), not already in the pass.
func (m *Message) fusable(c change) bool {
	return c.kind.advance && m.srv.views[c.stage] != nil &&
		!slices.Contains(m.link.chain, c.stage)
}

// runFused runs the stage that m's kept advance leads to, in the same pass (stage fusion, see
// ServeStages). It returns the message whose outcome stands and the fused stages that
// succeeded, from that stage on; nil when the stage failed: its writes are rolled back, the
// session is back in m's savepoint context, and m's advance is the outcome. An error ends the
// batch.
func (s *server) runFused(ctx context.Context, tx *sql.Tx, m *Message) (final *Message, fused []*Message, err error) {
	next := m.kept.change.stage
	view := m.srv.views[next]
	state, err := decodeState(m.kept.state)
	if err != nil { // cannot happen: json.Marshal wrote it; not worth failing the advance for
		view.noteFailure(m.ID, err.Error())
		return nil, nil, nil
	}
	var payload json.RawMessage
	if m.Payload != nil {
		payload = bytes.Clone(m.Payload) // a handler may scribble on its copy
	}
	saved := s.sess.currentLink()
	at := m.link.at // the stage the row is at in the transaction: moved by every link that wrote
	if saved.open {
		at = m.Stage
	}
	y := &Message{
		ID:      m.ID,
		Stage:   next,
		Payload: payload,
		State:   state,
		Tx:      tx,
		ctx:     ctx,
		srv:     view,
		live:    true,
		link: link{
			index:  m.link.index,
			prev:   m,
			chain:  append(slices.Clip(m.link.chain), next),
			at:     at,
			nested: m.link.nested || saved.open,
		},
	}
	s.sess.setLink(spLink{
		name:   "pepsi_msg_" + strconv.Itoa(m.link.index) + "_" + strconv.Itoa(len(y.link.chain)-1),
		nested: y.link.nested,
		move: "UPDATE workqueue SET stage = " + pq.QuoteLiteral(next) + ", attempts = 0" +
			" WHERE workqueue_id = " + strconv.FormatInt(m.ID, 10) +
			" AND status = 'running' AND stage = " + pq.QuoteLiteral(at),
	})
	final, fused, reason, err := s.runLink(ctx, tx, y)
	if err != nil {
		return nil, nil, err
	}
	if reason == "" {
		return final, fused, nil
	}
	view.noteFailure(m.ID, reason)
	s.sess.setLink(saved)
	return nil, nil, nil
}

// noteFailure logs that this view's fused stage failed for message id, at a limited rate:
// the first three of a run, then one in each power of ten. The dispatcher never sees such a
// failure; it sees the message again at this stage, where a real failure is counted.
func (s *server) noteFailure(id int64, reason string) {
	s.fuseFailures++
	n := s.fuseFailures
	if n > 3 && !isPowerOfTen(n) {
		return
	}
	s.log.Warn("fused stage failed; the message is advanced to it instead", "message", id,
		"reason", oneLine(reason), "fused_failures", n)
}

func isPowerOfTen(n int) bool {
	for n >= 10 && n%10 == 0 {
		n /= 10
	}
	return n == 1
}
