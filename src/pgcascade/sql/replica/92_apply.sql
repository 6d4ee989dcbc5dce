-- pgcascade.apply_rows(table, dest, keys, cols, lo, hi, skip_snapshot, row_filter) -> events applied.
-- The row-at-a-time apply, in ev_id order, of one table's row events staged in
-- pg_temp.pgcascade_stage with lo <= ev_id < hi.  Used where the set-based apply is unsafe:
-- the seed's partial-SQL events, a key unique on neither side, or a set-based attempt that
-- broke another unique constraint.  Events visible in skip_snapshot (the provider snapshot of
-- an initial copy) are already in the table and skipped.  `cols` are the columns written.
-- A U whose key is missing here inserts its row, as the set-based apply does.
-- With a row filter (the server's deparse of add-table --where: one expression, see
-- replica/filters.py) an I or U whose row passes it is upserted - an UPDATE that moved the
-- row into the filter inserts it - and one whose row fails it deletes the key - one that moved
-- it out removes it.
create or replace function pgcascade.apply_rows(
    i_table text, i_dest regclass, i_keys text[], i_cols text[], i_lo int8, i_hi int8, i_skip pg_snapshot,
    i_filter text default null)
returns int8
language plpgsql as $$
declare
    r record;
    n int8 := 0;
    keep bool;
    changed int8;
    collist text := array_to_string(array(select quote_ident(c) from unnest(i_cols) c), ', ');
    rcollist text := array_to_string(array(select 'r.' || quote_ident(c) from unnest(i_cols) c), ', ');
    keycond text := array_to_string(array(select format('t.%I = r.%I', k, k) from unnest(i_keys) k), ' and ');
    sql_ins text;
    sql_upd text;
    sql_del text;
    sql_keep text;
begin
    sql_ins := format('insert into %s (%s) select %s from pgcascade.event_row(null::%s, $1) r',
                      i_dest, collist, rcollist, i_dest);
    sql_upd := format('update %s t set (%s) = (select %s) from pgcascade.event_row(null::%s, $1) r where %s',
                      i_dest, collist, rcollist, i_dest, keycond);
    sql_del := format('delete from %s t using pgcascade.event_row(null::%s, $1) r where %s', i_dest, i_dest, keycond);
    -- the filter's names bind to the event's row, typed as the destination's
    sql_keep := format('select coalesce((%s), false) from pgcascade.event_row(null::%s, $1)', i_filter, i_dest);
    for r in execute 'select ev_type, ev_data from pg_temp.pgcascade_stage'
                     ' where ev_extra1 = $1 and ev_id >= $2 and ev_id < $3 and ev_type in (''I'', ''U'', ''D'')'
                     ' and ($4 is null or not txid_visible_in_snapshot(ev_txid, $4::text::txid_snapshot)) order by ev_id'
                   using i_table, i_lo, i_hi, i_skip loop
        if left(r.ev_data, 1) = '{' and i_filter is not null then
            keep := false;
            if r.ev_type <> 'D' then
                execute sql_keep into keep using r.ev_data;
            end if;
            if not keep then
                execute sql_del using r.ev_data;
            else
                execute sql_upd using r.ev_data;
                get diagnostics changed = row_count;
                if changed = 0 then
                    execute sql_ins using r.ev_data;
                end if;
            end if;
        elsif left(r.ev_data, 1) = '{' then
            case r.ev_type
                when 'I' then execute sql_ins using r.ev_data;
                when 'U' then
                    execute sql_upd using r.ev_data;
                    get diagnostics changed = row_count;
                    if changed = 0 then  -- a U is the row as it is now (90_capture.sql)
                        execute sql_ins using r.ev_data;
                    end if;
                else execute sql_del using r.ev_data;
            end case;
        elsif i_filter is not null then
            raise exception 'partial-SQL events of % cannot be filtered: add it on the root with --format=json', i_table
                using errcode = '22023';
        else
            case r.ev_type
                when 'I' then execute format('insert into %s %s', i_dest, r.ev_data);
                when 'U' then execute format('update %s set %s', i_dest, r.ev_data);
                else execute format('delete from %s where %s', i_dest, r.ev_data);
            end case;
        end if;
        n := n + 1;
    end loop;
    return n;
end $$;

-- pgcascade.tick_covers_snapshot(queue, tick_id, snapshot) -> whether every transaction visible in
-- `snapshot` is visible in the tick's snapshot too.  A copy process hands its table over only
-- at such a tick: events after it are then certainly not in the copied rows.
create or replace function pgcascade.tick_covers_snapshot(i_queue_name text, i_tick_id int8, i_snapshot pg_snapshot)
returns bool
language sql stable as $$
    select pg_snapshot_xmax(t.tick_snapshot) >= pg_snapshot_xmax(i_snapshot)
           and not exists (select 1 from pg_snapshot_xip(t.tick_snapshot) x
                            where x < pg_snapshot_xmax(i_snapshot) and pg_visible_in_snapshot(x, i_snapshot))
      from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue
     where q.queue_name = i_queue_name and t.tick_id = i_tick_id
$$;
