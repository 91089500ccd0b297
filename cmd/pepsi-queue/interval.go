// interval.go: reading the ages PostgreSQL prints (intervals) back as seconds.

package main

import (
	"regexp"
	"strconv"
	"strings"
)

// parseInterval reads an interval as PostgreSQL prints it under any of the four IntervalStyle
// settings, since a role or database may set one other than the default (postgres):
//
//	postgres          1 year 2 mons -3 days +04:05:06.5
//	postgres_verbose  @ 1 year 2 mons -3 days 4 hours 5 mins 6.5 secs ago
//	sql_standard      +1-2 -3 +4:05:06.5, or one sign for all: -3 4:05:06.5, 1-2, 0
//	iso_8601          P1Y2M-3DT4H5M6.5S
//
// and returns the seconds PostgreSQL's own extract(epoch FROM i) gives: a year is 365.25 days,
// a month 30 days (interval_test.go holds the two to each other, both ways). An age outside
// these forms is false, and printed as PostgreSQL wrote it.
func parseInterval(s string) (float64, bool) {
	var iv interval
	var ok bool
	switch {
	case strings.HasPrefix(s, "P"):
		ok = iv.iso(s)
	case strings.HasPrefix(s, "@"):
		ok = iv.verbose(s)
	default:
		// The two forms cannot both match; a failed attempt may have added a part, so the
		// second starts afresh.
		if ok = iv.postgres(s); !ok {
			iv = interval{}
			ok = iv.sqlStandard(s)
		}
	}
	if !ok {
		return 0, false
	}
	return iv.epoch(), true
}

// interval holds PostgreSQL's three fields of an interval: months, days and seconds.
type interval struct {
	months, days int64
	secs         float64
}

func (iv interval) epoch() float64 {
	// C's division and remainder, both truncating toward zero, as interval_part has them.
	years, months := iv.months/12, iv.months%12
	return float64(years)*365.25*86400 + float64(months)*30*86400 + float64(iv.days)*86400 + iv.secs
}

// add adds n of unit, a word of postgres_verbose (iso names its letters so).
func (iv *interval) add(n, unit string) bool {
	if unit == "sec" || unit == "secs" {
		f, err := strconv.ParseFloat(n, 64)
		if err != nil || !decimalRe.MatchString(n) {
			return false
		}
		iv.secs += f
		return true
	}
	i, err := strconv.ParseInt(n, 10, 64)
	if err != nil { // base 10: a sign and digits, nothing else
		return false
	}
	switch unit {
	case "year", "years":
		iv.months += 12 * i
	case "mon", "mons":
		iv.months += i
	case "day", "days":
		iv.days += i
	case "hour", "hours":
		iv.secs += float64(i) * 3600
	case "min", "mins":
		iv.secs += float64(i) * 60
	default:
		return false
	}
	return true
}

var (
	decimalRe = regexp.MustCompile(`^[-+]?[0-9]+(?:\.[0-9]+)?$`)
	// clockRe is the time of day of postgres and sql_standard: [sign]H:MM:SS[.frac], hours unbounded.
	clockRe = regexp.MustCompile(`^([-+]?)([0-9]+):([0-9]{2}):([0-9]{2}(?:\.[0-9]+)?)$`)
	// isoRe: P[nY][nM][nD][T[nH][nM][nS]], each number signed on its own.
	isoRe = regexp.MustCompile(`^P(?:([-+]?[0-9]+)Y)?(?:([-+]?[0-9]+)M)?(?:([-+]?[0-9]+)D)?` +
		`(?:T(?:([-+]?[0-9]+)H)?(?:([-+]?[0-9]+)M)?(?:([-+]?[0-9]+(?:\.[0-9]+)?)S)?)?$`)
)

// clock adds a time of day; sign is applied to it whole (sql_standard's one sign for all).
func (iv *interval) clock(s string, sign float64) bool {
	m := clockRe.FindStringSubmatch(s)
	if m == nil {
		return false
	}
	h, _ := strconv.ParseFloat(m[2], 64)
	mi, _ := strconv.ParseFloat(m[3], 64)
	se, _ := strconv.ParseFloat(m[4], 64)
	t := h*3600 + mi*60 + se
	if m[1] == "-" {
		t = -t
	}
	iv.secs += sign * t
	return true
}

// postgres: "N unit" pairs (year, mon, day), then a time of day, each part signed on its own.
func (iv *interval) postgres(s string) bool {
	f := strings.Split(s, " ")
	if len(f)%2 == 1 {
		if !iv.clock(f[len(f)-1], 1) {
			return false
		}
		f = f[:len(f)-1]
	}
	for i := 0; i < len(f); i += 2 {
		switch f[i+1] {
		case "year", "years", "mon", "mons", "day", "days":
		default:
			return false
		}
		if !iv.add(f[i], f[i+1]) {
			return false
		}
	}
	return len(s) > 0
}

// verbose: "@", "N unit" pairs, "0" alone, and "ago" at the end negating the whole.
func (iv *interval) verbose(s string) bool {
	f := strings.Split(s, " ")
	if f[0] != "@" {
		return false
	}
	f = f[1:]
	if len(f) == 1 && f[0] == "0" {
		return true
	}
	ago := len(f) > 0 && f[len(f)-1] == "ago"
	if ago {
		f = f[:len(f)-1]
	}
	if len(f) == 0 || len(f)%2 == 1 {
		return false
	}
	for i := 0; i < len(f); i += 2 {
		if !iv.add(f[i], f[i+1]) {
			return false
		}
	}
	if ago {
		iv.months, iv.days, iv.secs = -iv.months, -iv.days, -iv.secs
	}
	return true
}

// sqlStandard: "0"; with one sign for the whole, Y-M, D H:MM:SS or H:MM:SS; with mixed signs,
// all three parts each signed: +Y-M +D +H:MM:SS.
func (iv *interval) sqlStandard(s string) bool {
	if s == "0" {
		return true
	}
	f := strings.Split(s, " ")
	if len(f) == 3 {
		// PostgreSQL writes the three parts only in the mixed form, and then signs each: a part
		// without its sign ("-1-0 2 0:00:01") is its input's form, where the first sign holds
		// for all (-1 year -2 days -1 s), which this read as -1 year +2 days +1 s
		// (FuzzParseInterval).
		for _, p := range f {
			if p == "" || (p[0] != '+' && p[0] != '-') {
				return false
			}
		}
		ym, ok := yearMonth(f[0])
		if !ok {
			return false
		}
		d, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return false
		}
		iv.months, iv.days = ym, d
		return iv.clock(f[2], 1)
	}
	sign, rest := int64(1), s
	if strings.HasPrefix(s, "-") {
		sign, rest = -1, s[1:]
	}
	f = strings.Split(rest, " ")
	for _, p := range f {
		if strings.HasPrefix(p, "-") || strings.HasPrefix(p, "+") { // a sign of its own: the mixed form
			return false
		}
	}
	switch len(f) {
	case 1:
		if ym, ok := yearMonth(f[0]); ok {
			iv.months = sign * ym
			return true
		}
		return iv.clock(f[0], float64(sign))
	case 2:
		d, err := strconv.ParseUint(f[0], 10, 63)
		if err != nil {
			return false
		}
		iv.days = sign * int64(d)
		return iv.clock(f[1], float64(sign))
	}
	return false
}

// yearMonth reads [sign]Y-M as months.
func yearMonth(s string) (int64, bool) {
	sign := int64(1)
	if s != "" && (s[0] == '-' || s[0] == '+') {
		if s[0] == '-' {
			sign = -1
		}
		s = s[1:]
	}
	y, m, ok := strings.Cut(s, "-")
	if !ok {
		return 0, false
	}
	yi, err1 := strconv.ParseUint(y, 10, 31)
	mi, err2 := strconv.ParseUint(m, 10, 31)
	if err1 != nil || err2 != nil || mi > 11 {
		return 0, false
	}
	return sign * (int64(yi)*12 + int64(mi)), true
}

// iso reads ISO 8601's format with designators, as PostgreSQL prints it.
func (iv *interval) iso(s string) bool {
	m := isoRe.FindStringSubmatch(s)
	if m == nil || s == "P" || strings.HasSuffix(s, "T") {
		return false
	}
	// M is a month before the T and a minute after it.
	units := []string{"", "year", "mon", "day", "hour", "min", "sec"}
	for i := 1; i < len(m); i++ {
		if m[i] != "" && !iv.add(m[i], units[i]) {
			return false
		}
	}
	return true
}
