// output.go: printing query results as an aligned table or as JSON lines.
//
// JSON: one object per row, the column names as keys; numbers and booleans as JSON numbers and
// booleans, times in RFC 3339, intervals (ages) in seconds, arrays as JSON arrays, NULL as null.
// The table: ages as 3m12s, times in UTC to the second, errors cut to one line; in it and in
// show, what a terminal would act on is written as an escape (internal/printable).

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lib/pq"
	"pepsi-dispatch/internal/printable"
)

// query runs q and prints its rows.
func (e *env) query(ctx context.Context, q string, args ...any) error {
	rows, err := e.db.QueryContext(ctx, q, args...)
	if err != nil {
		return fmt.Errorf("%s: %w", e.inv.command, err)
	}
	defer rows.Close()
	cols, err := rows.ColumnTypes()
	if err != nil {
		return fmt.Errorf("%s: %w", e.inv.command, err)
	}
	names := make([]string, len(cols))
	for i, c := range cols {
		names[i] = c.Name()
	}
	var tw *tabwriter.Writer
	if !e.inv.json {
		tw = tabwriter.NewWriter(e.out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, strings.ToUpper(strings.Join(names, "\t")))
	}
	for rows.Next() {
		raw := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range raw {
			ptrs[i] = &raw[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return fmt.Errorf("%s: %w", e.inv.command, err)
		}
		vals := make([]any, len(cols))
		for i, c := range cols {
			vals[i] = convert(c.DatabaseTypeName(), raw[i])
		}
		if e.inv.json {
			writeJSON(e.out, names, vals)
			continue
		}
		cells := make([]string, len(cols))
		for i, v := range vals {
			cells[i] = cell(names[i], v)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("%s: %w", e.inv.command, err)
	}
	if tw != nil {
		return tw.Flush()
	}
	return nil
}

// age is an interval, kept apart from other numbers for the table's format.
type age float64

// convert turns a scanned value into what JSON and the table print.
func convert(typ string, v any) any {
	if v == nil {
		return nil
	}
	switch typ {
	case "INTERVAL":
		s := asString(v)
		if secs, ok := parseInterval(s); ok {
			return age(secs)
		}
		return s
	case "_TEXT", "_VARCHAR":
		var a pq.StringArray
		if err := a.Scan(v); err == nil {
			return []string(a)
		}
	case "_INT8", "_INT4":
		var a pq.Int64Array
		if err := a.Scan(v); err == nil {
			return []int64(a)
		}
	case "JSONB", "JSON":
		return json.RawMessage(asString(v))
	case "NUMERIC":
		if f, err := strconv.ParseFloat(asString(v), 64); err == nil {
			return f
		}
	}
	if b, ok := v.([]byte); ok {
		return string(b)
	}
	return v
}

func asString(v any) string {
	switch v := v.(type) {
	case []byte:
		return string(v)
	case string:
		return v
	}
	return fmt.Sprint(v)
}

// writeJSON prints one JSON object with the keys in column order.
func writeJSON(w io.Writer, names []string, vals []any) {
	var b strings.Builder
	b.WriteByte('{')
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(n)
		b.Write(k)
		b.WriteByte(':')
		var v []byte
		var err error
		switch x := vals[i].(type) {
		case age:
			v, err = json.Marshal(float64(x))
		case time.Time:
			v, err = json.Marshal(x.UTC().Format(time.RFC3339Nano))
		default:
			v, err = json.Marshal(x)
		}
		if err != nil {
			v, _ = json.Marshal(fmt.Sprint(vals[i]))
		}
		b.Write(v)
	}
	b.WriteString("}\n")
	io.WriteString(w, b.String())
}

// cell formats one value for the table.
func cell(name string, v any) string {
	switch x := v.(type) {
	case nil:
		if name == "stage" {
			return "TOTAL"
		}
		return "-"
	case age:
		return formatAge(float64(x))
	case time.Time:
		return x.UTC().Format("2006-01-02 15:04:05Z")
	case bool:
		if name == "stage_paused" {
			if x {
				return "PAUSED"
			}
			return "-"
		}
		return strconv.FormatBool(x)
	case []string:
		return printable.String(strings.Join(x, ","))
	case string:
		line, _, cut := strings.Cut(x, "\n")
		line = strings.ReplaceAll(line, "\t", " ")
		if i := runeOffset(line, 100); i < len(line) {
			line, cut = line[:i], true
		}
		line = printable.String(line)
		if cut {
			line += "…"
		}
		return line
	}
	return fmt.Sprint(v)
}

// runeOffset is the byte offset of s's n-th character (len(s) when it has no more): a cut
// there leaves UTF-8 whole.
func runeOffset(s string, n int) int {
	for i := range s {
		if n == 0 {
			return i
		}
		n--
	}
	return len(s)
}

// formatAge prints seconds as 45s, 3m12s, 5h03m, 2d04h.
func formatAge(s float64) string {
	d := time.Duration(s * float64(time.Second))
	switch {
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// printMessage prints a message of queue_show as "key: value" lines, the usual ones first.
func printMessage(w io.Writer, msg []byte) error {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(msg, &m); err != nil {
		return err
	}
	first := []string{"workqueue_id", "stage", "status", "attempts", "status_at", "retry_at",
		"created_at", "claimed_at", "claim", "error_signature", "payload", "state"}
	done := map[string]bool{}
	keys := append([]string(nil), first...)
	var rest []string
	for k := range m {
		if !contains(first, k) {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	keys = append(keys, rest...)
	for _, k := range keys {
		v, ok := m[k]
		if !ok || done[k] {
			continue
		}
		done[k] = true
		s := string(v)
		if s == "null" {
			continue
		}
		if len(s) > 1 && s[0] == '"' {
			var str string
			if json.Unmarshal(v, &str) == nil {
				s = str
			}
		}
		// The row's times in UTC, as the tables give theirs: PostgreSQL's JSON text is in
		// the session's TimeZone, the server's (+13:45 under Pacific/Chatham).
		if strings.HasSuffix(k, "_at") {
			if at, err := time.Parse(time.RFC3339Nano, s); err == nil {
				s = at.UTC().Format("2006-01-02 15:04:05.999999Z")
			}
		}
		fmt.Fprintf(w, "%-16s %s\n", k+":", printable.String(s))
	}
	fmt.Fprintln(w)
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
