-- pgcascade.apply_repair(ev_id, dest, keys, cols, row_filter) -> rows inserted.
-- Applies the `pgcascade.repair` event staged in pg_temp.pgcascade_stage with this ev_id (made by
-- the root's emit_repair, sql/capture/96_repair.sql) to `dest`: deletes the rows of the event's
-- keys, then inserts its row images (columns `cols`: those both sides have, none generated, of
-- a leaf's column list) - on a leaf with a row filter, those that pass it.
-- Runs in the batch's transaction, at the event's place among the batch's other events.
drop function if exists pgcascade.apply_repair(int8, regclass, text[], text[]);  -- before the filter
create or replace function pgcascade.apply_repair(i_ev_id int8, i_dest regclass, i_keys text[], i_cols text[],
                                                  i_filter text default null)
returns int8
language plpgsql as $$
declare
    v_data json;
    v_coldefs text;
    v_match text;
    v_cols text := array_to_string(array(select quote_ident(c) from unnest(i_cols) c), ', ');
    v_rcols text := array_to_string(array(select 'r.' || quote_ident(c) from unnest(i_cols) c), ', ');
    v_rows int8;
begin
    select ev_data::json into v_data from pg_temp.pgcascade_stage where ev_id = i_ev_id;
    select string_agg(format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod)), ', ' order by k.n),
           string_agg(format('t.%I = k.%I', a.attname, a.attname), ' and ' order by k.n)
      into v_coldefs, v_match
      from unnest(i_keys) with ordinality k(col, n)
      join pg_attribute a on a.attrelid = i_dest and a.attname = k.col and a.attnum > 0 and not a.attisdropped;
    if json_array_length(v_data -> 'keys') > 0 then
        execute format('delete from %s t using json_to_recordset($1) as k(%s) where %s', i_dest, v_coldefs, v_match)
          using v_data -> 'keys';
    end if;
    -- the filter's names bind to the row's columns only (replica/filters.py)
    execute format('insert into %s (%s) overriding system value select %s'
                   ' from json_array_elements($1) e cross join lateral pgcascade.event_row(null::%s, e.value::text) r%s',
                   i_dest, v_cols, v_rcols, i_dest,
                   case when i_filter is not null
                        then format(' where coalesce((select %s from (select r.*) pgcascade_f), false)', i_filter) end)
      using v_data -> 'rows';
    get diagnostics v_rows = row_count;
    return v_rows;
end $$;
