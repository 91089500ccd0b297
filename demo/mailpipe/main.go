// Command mailpipe is the demo's stage program: three stages of a mail-like flow, built with
// the stage SDK. One binary serves every stage; PEPSI_STAGE says which.
//
//	parse    payload {"from","to","subject","body"} -> normalised addresses in state -> enrich
//	enrich   a route for every recipient's domain (a static table here) -> deliver
//	deliver  one demo_mailbox row per recipient, in the message's own transaction -> done
//
// A message whose addresses do not parse is not retried (it never will parse): it is finished
// at parse with state.rejected. A recipient whose domain is listed in demo_outage (the demo's
// stand-in for a relay that is down) fails at deliver with a connection error, so the demo
// has one cause of failure to find and retry. demo_mailbox and demo_outage are created by
// demo/run:
//
//	CREATE TABLE demo_mailbox (workqueue_id bigint, recipient text, sender text, subject text,
//	                           route text, size int, PRIMARY KEY (workqueue_id, recipient))
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/mail"
	"strings"

	"github.com/lib/pq"

	"pepsi-dispatch/stage"
)

func main() {
	stage.Run(handle)
}

// handle picks the stage's handler; the SDK guards every outcome with m.Stage.
func handle(ctx context.Context, m *stage.Message) error {
	switch m.Stage {
	case "parse":
		return parse(m)
	case "enrich":
		return enrich(m)
	case "deliver":
		return deliver(ctx, m)
	}
	return fmt.Errorf("mailpipe serves the stages parse, enrich and deliver, not %q", m.Stage)
}

// envelope is the payload set at enqueue.
type envelope struct {
	From    string `json:"from"`
	To      string `json:"to"` // one address or a comma-separated list
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

func parse(m *stage.Message) error {
	var env envelope
	if err := json.Unmarshal(m.Payload, &env); err != nil {
		return reject(m, fmt.Sprintf("payload is not an envelope: %v", err))
	}
	from, err := mail.ParseAddress(env.From)
	if err != nil {
		return reject(m, fmt.Sprintf("from %q: %v", env.From, err))
	}
	to, err := mail.ParseAddressList(env.To)
	if err != nil {
		return reject(m, fmt.Sprintf("to %q: %v", env.To, err))
	}
	rcpts := make([]any, 0, len(to))
	for _, a := range to {
		rcpts = append(rcpts, normalise(a.Address))
	}
	m.State["from"] = normalise(from.Address)
	m.State["from_name"] = from.Name
	m.State["to"] = rcpts
	m.State["subject"] = strings.TrimSpace(env.Subject)
	m.State["size"] = len(env.Body)
	return m.Advance("enrich")
}

// reject finishes a message that can never be delivered; retrying would not change it.
func reject(m *stage.Message, why string) error {
	m.State["rejected"] = why
	return m.Done()
}

// normalise lower-cases the domain of an address; the local part is the recipient's own.
func normalise(addr string) string {
	local, domain, ok := strings.Cut(addr, "@")
	if !ok {
		return addr
	}
	return local + "@" + strings.ToLower(domain)
}

// routes is the demo's stand-in for a DNS or directory lookup.
var routes = map[string]string{
	"example.com": "local:mailstore-1",
	"example.org": "relay:mx1.example.org",
	"example.net": "relay:mx2.example.net",
}

func enrich(m *stage.Message) error {
	rcpts, err := recipients(m)
	if err != nil {
		return err
	}
	route := map[string]any{}
	for _, r := range rcpts {
		_, domain, _ := strings.Cut(r, "@")
		rt, ok := routes[domain]
		if !ok {
			rt = "smtp:mx." + domain
		}
		route[r] = rt
	}
	m.State["route"] = route
	return m.Advance("deliver")
}

func deliver(ctx context.Context, m *stage.Message) error {
	rcpts, err := recipients(m)
	if err != nil {
		return err
	}
	route, _ := m.State["route"].(map[string]any)
	from, _ := m.State["from"].(string)
	subject, _ := m.State["subject"].(string)
	size, _ := m.State["size"].(json.Number) // the SDK decodes numbers as json.Number
	bytes, _ := size.Int64()
	// One statement for all recipients: the rows commit with the outcome, or not at all, and
	// a redelivery after a crash finds them there already.
	routeOf := make([]string, len(rcpts))
	for i, r := range rcpts {
		routeOf[i], _ = route[r].(string)
	}
	var down string
	err = m.Tx.QueryRowContext(ctx, `
		SELECT o.domain FROM demo_outage o, unnest($1::text[]) AS r(rcpt)
		 WHERE split_part(r.rcpt, '@', 2) = o.domain LIMIT 1`, pq.Array(rcpts)).Scan(&down)
	if err == nil {
		return fmt.Errorf("connect to mx.%s[192.0.2.%d]:25: connection refused after %d ms",
			down, 1+m.ID%254, 20+m.ID%80)
	} else if !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("deliver message %d: look up outages: %w", m.ID, err)
	}
	_, err = m.Tx.ExecContext(ctx, `
		INSERT INTO demo_mailbox (workqueue_id, recipient, sender, subject, route, size)
		SELECT $1, r.rcpt, $3, $4, r.route, $5
		  FROM unnest($2::text[], $6::text[]) AS r(rcpt, route)
		ON CONFLICT DO NOTHING`,
		m.ID, pq.Array(rcpts), from, subject, bytes, pq.Array(routeOf))
	if err != nil {
		return fmt.Errorf("deliver message %d: %w", m.ID, err)
	}
	m.State["delivered"] = len(rcpts)
	return m.Done()
}

// recipients reads the recipients that parse put into the state.
func recipients(m *stage.Message) ([]string, error) {
	list, ok := m.State["to"].([]any)
	if !ok || len(list) == 0 {
		return nil, errors.New("state has no recipients: was the message parsed?")
	}
	out := make([]string, 0, len(list))
	for _, v := range list {
		s, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("state recipient %v is not a string", v)
		}
		out = append(out, s)
	}
	return out, nil
}
