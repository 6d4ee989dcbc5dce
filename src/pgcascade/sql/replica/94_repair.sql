-- pgcascade.apply_repair(ev_id, dest, keys, cols, row_filter) -> rows written.
-- Applies the `pgcascade.repair` event staged in pg_temp.pgcascade_stage with this ev_id (made by
-- the root's emit_repair, sql/capture/96_repair.sql) to `dest`: the event's keys end up as the
-- root has them - a key whose row the event carries (and this node's row filter, if any, keeps)
-- is updated or inserted, any other of its keys deleted.  Only `cols` are written (those both
-- sides have, of a column list; none generated), as the apply writes them, so columns of this
-- node's own keep their values.  Runs in the batch's transaction, at the event's place.
drop function if exists pgcascade.apply_repair(int8, regclass, text[], text[]);  -- before the filter
create or replace function pgcascade.apply_repair(
    i_ev_id int8, i_dest regclass, i_keys text[], i_cols text[], i_filter text default null)
returns int8
language plpgsql as $$
declare
    v_data json;
    v_coldefs text;
    v_match text;
    v_kept text;  -- the event's rows this node holds, typed as the destination's ($2: the rows)
    v_cols text := array_to_string(array(select quote_ident(c) from unnest(i_cols) c), ', ');
    v_rcols text := array_to_string(array(select 'r.' || quote_ident(c) from unnest(i_cols) c), ', ');
    v_sets text[] := array(select quote_ident(c) from unnest(i_cols) c where c <> all(i_keys));
    v_rmatch text := array_to_string(array(select format('t.%I = r.%I', k, k) from unnest(i_keys) k), ' and ');
    v_n int8;
    v_written int8 := 0;
begin
    select ev_data::json into v_data from pg_temp.pgcascade_stage where ev_id = i_ev_id;
    select string_agg(format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod)), ', ' order by k.n),
           string_agg(format('t.%I = k.%I', a.attname, a.attname), ' and ' order by k.n)
      into v_coldefs, v_match
      from unnest(i_keys) with ordinality k(col, n)
      join pg_attribute a on a.attrelid = i_dest and a.attname = k.col and a.attnum > 0 and not a.attisdropped;
    v_kept := format('select r.* from json_array_elements($2) e cross join lateral pgcascade.event_row(null::%s, e.value::text) r',
                     i_dest);
    if i_filter is not null then  -- the server's deparse of add-table --where (replica/filters.py)
        v_kept := v_kept || format(' where coalesce((select %s from (select r.*) pgcascade_f), false)', i_filter);
    end if;
    execute format('delete from %s t using json_to_recordset($1) as k(%s) where %s'
                   ' and not exists (select 1 from (%s) r where %s)', i_dest, v_coldefs, v_match, v_kept, v_rmatch)
      using v_data -> 'keys', v_data -> 'rows';
    get diagnostics v_n = row_count;
    v_written := v_n;
    if cardinality(v_sets) > 0 then
        execute format('update %s t set (%s) = row(%s) from (%s) r where %s', i_dest,
                       array_to_string(v_sets, ', '),
                       array_to_string(array(select 'r.' || s from unnest(v_sets) s), ', '), v_kept, v_rmatch)
          using v_data -> 'keys', v_data -> 'rows';
        get diagnostics v_n = row_count;
        v_written := v_written + v_n;
    end if;
    execute format('insert into %s (%s) overriding system value select %s from (%s) r'
                   ' where not exists (select 1 from %s t where %s)', i_dest, v_cols, v_rcols, v_kept, i_dest, v_rmatch)
      using v_data -> 'keys', v_data -> 'rows';
    get diagnostics v_n = row_count;
    return v_written + v_n;
end $$;
